"""What the bench runs: the policy names, the size presets, and the cache each name stands for.

Two stock baselines run the unmodified model with SDPA attention: `full-sdpa` with transformers'
`DynamicCache` (grows by concatenation every step) and `static-sdpa` with its `StaticCache`
(preallocated for prompt + generated tokens, written in place: the faster stock decode path).
Every other name is an h2o-kv policy built by `h2o_kv.policies.build` at the bench's budget,
resolved against the prompt length; a name ending in `-int8` (e.g. `h2o-int8`) stores its kept keys
and values as int8 with per-token scales (`KVCache(kv_dtype="int8")`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from h2o_kv import policies
from h2o_kv.policies import Budget, budget_tokens, check_budget_value

if TYPE_CHECKING:  # torch, transformers and the cache import where a cache is made (the CLI parses flags first)
    import torch
    from transformers import DynamicCache, StaticCache

    from h2o_kv.cache.kvcache import KVCache
    from h2o_kv.policies import Policy

    Cache = DynamicCache | StaticCache | KVCache
else:
    Cache = Any  # a stock cache or h2o-kv's: the union above, for type checkers
Row = dict[str, Any]

DYNAMIC = "full-sdpa"  # the stock model: SDPA attention, transformers' DynamicCache
STATIC = "static-sdpa"  # the stock model: SDPA attention, transformers' StaticCache
BASELINES = (DYNAMIC, STATIC)
BASELINE_LABELS = {DYNAMIC: "dynamic", STATIC: "static"}  # column suffixes: decode_tok_s_vs_static ...
POLICIES = (DYNAMIC, STATIC, "h2o", "local", "streamingllm", "tova")
EXTRA_POLICIES = ("snapkv", "full-kv")  # full-kv: h2o_kv.KVCache(Full()), h2o-kv's attention path, no eviction
INT8 = "-int8"  # suffix: the same policy with int8 KV storage
SIZES: dict[str, dict[str, Any]] = {
    "small": dict(prompt_lens=[256, 1024], batch_sizes=[1, 2], gen_len=32, repeats=1, warmup=0),
    "large": dict(prompt_lens=[1024, 4096], batch_sizes=[1, 4], gen_len=64, repeats=3, warmup=0),
}
SAME_MEMORY_MAX_BATCH = 64  # keeps the "bigger batch" run affordable on a CPU
SAME_MEMORY_POLICIES = (*BASELINES, "h2o", "h2o" + INT8)  # run at the same KV memory when they were swept


def policy_for(name: str, budget: Budget, prompt_len: int) -> Policy | None:
    """The h2o-kv policy `name` at `budget` for prompts of `prompt_len` tokens; None for a stock baseline.

    `budget` is tokens (int) or a fraction of the prompt (float in (0, 1]), as `policies.parse_budget`
    reads `--budget`; it is turned into tokens here, so every sequence of a run keeps the same count.
    """
    if name in BASELINES:
        return None
    name = name.removesuffix(INT8)
    if name == "full-kv":
        return policies.build("full")
    if name == "full":
        raise ValueError(f"say {DYNAMIC!r} or {STATIC!r} (stock model) or 'full-kv' (h2o-kv's path, no eviction)")
    return policies.build(name, budget_tokens(budget, prompt_len))


def describe(name: str, policy: Policy | None) -> str:
    if name == DYNAMIC:
        return "Full (SDPA, DynamicCache)"
    if name == STATIC:
        return "Full (SDPA, StaticCache)"
    assert policy is not None, name
    return policy.describe() + (" int8" if name.endswith(INT8) else "")


def new_cache(
    model: torch.nn.Module, name: str, policy: Policy | None, *, max_len: int, prefill_chunk: int | None = None
) -> Cache:
    """A fresh cache for `name`, with the model switched to the attention path that cache needs.

    `max_len` (prompt + generated tokens) sizes the StaticCache; the other caches ignore it.
    """
    from transformers import DynamicCache, StaticCache

    from h2o_kv.cache.kvcache import KVCache

    use_path(model, name)
    if name == STATIC:
        return StaticCache(config=model.config, max_cache_len=max_len)
    if name == DYNAMIC:
        return DynamicCache(config=model.config)
    return KVCache(policy, prefill_chunk=prefill_chunk, kv_dtype="int8" if name.endswith(INT8) else None)


def use_path(model: torch.nn.Module, name: str) -> None:
    """Switch the model to the attention path `name`'s cache needs: SDPA for a stock cache, h2o-kv's otherwise."""
    from h2o_kv.cache.attention import enable

    if name in BASELINES:
        model.set_attn_implementation("sdpa")
    else:
        enable(model)


def check_run(
    policies: Sequence[str],
    budget: Budget,
    prompt_lens: Sequence[int],
    gen_len: int,
    batch_sizes: Sequence[int],
    repeats: int,
    warmup: int,
    threads: Sequence[int | None],
    prefill_chunk: int | None = None,
    memory_cap_gb: float | None = None,
) -> None:
    """Reject a run that cannot mean anything before any model call (unknown policy, empty sizes...)."""
    if not policies or not prompt_lens or not batch_sizes or not threads:
        raise ValueError("bench needs at least one policy, prompt length, batch size and thread count")
    if min(prompt_lens) < 1 or min(batch_sizes) < 1 or gen_len < 1 or repeats < 1 or warmup < 0:
        raise ValueError("prompt lengths, batch sizes, gen_len and repeats must be >= 1 (warmup >= 0)")
    if any(t is not None and t < 0 for t in threads):
        raise ValueError(f"threads must be >= 1 (or 0 for the machine's default), got {list(threads)}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 (or None: the whole prompt at once), got {prefill_chunk}")
    if memory_cap_gb is not None and not 0 < memory_cap_gb < math.inf:  # also refuses nan
        raise ValueError(f"memory_cap_gb must be a positive number of GB, got {memory_cap_gb}")
    check_budget_value(budget, "bench budget")
    for name in policies:
        policy_for(name, budget, min(prompt_lens))

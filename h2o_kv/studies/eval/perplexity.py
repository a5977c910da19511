"""Streaming perplexity (the PG-19 protocol): every token passes through the evicting cache.

One model call over a window with ``KVCache(policy, prefill_chunk=c)`` equals feeding the window
``c`` tokens at a time with eviction in between (``c=1``: token by token), so the logits of that single
call are each token's next-token prediction under the bounded cache. Windows are cut from several
texts of the corpus (different plays for the default Shakespeare corpus).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.runtime.generation import forward
from h2o_kv.studies.data import load_texts
from h2o_kv.studies.eval.decoding import new_cache

LOGITS_BYTES = 1 << 30  # windows per forward are limited so the logits stay under ~1 GiB


def text_windows(
    tokenizer: Any, corpus: str | None, *, n: int, length: int, seed: int = 0, max_chars: int = 20_000_000
) -> torch.Tensor:
    """[n, length] token windows from `corpus` (see `h2o_kv.studies.data.load_texts`), one per text where possible.

    Texts too short for a window are skipped; if none is long enough, all texts are joined into one.
    Windows are spread evenly over the usable texts and start at a seeded offset (past the first
    tenth, which in plays is mostly the cast list); several windows from one text never overlap.
    """
    texts = load_texts(corpus, max_chars=max_chars)
    rng = random.Random(seed)
    usable = [t for t in texts if len(t) >= 6 * length]
    if not usable:
        usable = ["\n\n".join(texts)]
    picks = [usable[(i * len(usable)) // n] if n <= len(usable) else usable[i % len(usable)] for i in range(n)]
    per_text: dict[int, list[int]] = {}
    for i, text in enumerate(picks):
        per_text.setdefault(id(text), []).append(i)
    by_index: dict[int, list[int]] = {}
    for idxs in per_text.values():
        text = picks[idxs[0]]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        start0 = len(ids) // 10 if len(ids) >= 2 * length else 0
        segment = (len(ids) - start0) // len(idxs)
        if segment < length:
            raise ValueError(f"corpus text too short for {len(idxs)} window(s) of {length} tokens")
        for k, i in enumerate(idxs):
            start = start0 + k * segment + rng.randrange(segment - length + 1)
            by_index[i] = ids[start : start + length]
    return torch.tensor([by_index[i] for i in range(n)], dtype=torch.long)


@torch.no_grad()
def stream_nll(
    model: Any,
    ids: torch.Tensor,
    policy: str,
    budget: Budget,
    *,
    mode: Mode = "drop",
    chunk: int | None = 1,
) -> torch.Tensor:
    """Per-token NLL [B, L-1] of `ids` [B, L] when every token streams through the evicting cache.

    The budget is sized from the window length L. `chunk` tokens are fed between evictions (1 is
    token by token; larger is faster, and the cache then holds up to budget + chunk - 1 tokens).
    """
    batch, length = ids.shape
    if policy.lower() == "full" or budget is None:
        chunk = None  # nothing is evicted, so one pass gives the same logits, faster
    per_call = max(1, LOGITS_BYTES // max(1, length * model.config.vocab_size * 4))
    out = []
    for start in range(0, batch, per_call):
        part = ids[start : start + per_call]
        cache = new_cache(policy, budget, length, mode=mode, chunk=chunk)
        logits = forward(model, cache, part.to(model.device), all_logits=True)[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), part[:, 1:].to(logits.device), reduction="none")
        out.append(nll)
        del logits, cache
    return torch.cat(out)


def perplexity_stats(nll: torch.Tensor) -> dict[str, float]:
    """Perplexity over all scored tokens, and the mean and spread of the per-window perplexities."""
    per_window = nll.double().mean(1).exp()
    return {
        "ppl": math.exp(float(nll.double().mean())),
        "ppl_windows_mean": float(per_window.mean()),
        "ppl_windows_std": float(per_window.std()) if len(per_window) > 1 else 0.0,
    }


def run_perplexity(
    model: Any,
    windows: torch.Tensor,
    configs: Sequence[tuple[str, Budget]],
    *,
    mode: Mode = "drop",
    chunk: int | None = 1,
    progress: Any = None,
) -> list[dict]:
    """One row per (policy, budget): perplexity of the windows under that cache."""
    rows = []
    length = windows.shape[1]
    for policy, budget in configs:
        nll = stream_nll(model, windows, policy, budget, mode=mode, chunk=chunk)
        rows.append({"policy": policy, "budget": budget, "length": length, **perplexity_stats(nll)})
        if progress is not None:
            progress.update(1)
    return rows

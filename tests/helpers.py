"""What several test files share: the tables of policies and call schedules, a driver that runs one cache layer
as a model's attention does, the model decode loop, and the tolerances."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import h2o_kv
from h2o_kv.cache.layer import KVLayer, Settings
from h2o_kv.cache.pooled import PooledKVLayer

from conftest import random_ids

POLICIES = {
    "h2o": (h2o_kv.H2O(heavy=3, recent=2), 5, {"recent": 2}),
    "local": (h2o_kv.Local(window=4), 4, {}),
    "streaming": (h2o_kv.StreamingLLM(sinks=2, window=3), 5, {"sinks": 2}),
    "tova": (h2o_kv.TOVA(budget=4), 4, {}),
    "keydiff": (h2o_kv.KeyDiff(budget=4, recent=1), 4, {"recent": 1}),
}


SCHEDULES = {
    "token_by_token": [1] * 16,
    "one_call": [16],
    "mixed": [7, 1, 1, 5, 1, 1],
}


# policies beyond the paper's H2O, as (policy, reference rule, capacity, the reference's params)
BEYOND = {
    "snapkv": (h2o_kv.SnapKV(budget=6, window=4, pool=3), "snapkv", 6, {"recent": 3, "observe": 4, "pool": 3}),
    "snapkv_wide_window": (h2o_kv.SnapKV(budget=6, window=2, pool=5), "snapkv", 6,
                           {"recent": 2, "observe": 2, "pool": 5}),
    "snapkv_shared": (h2o_kv.SnapKV(budget=6, window=4, pool=3, shared=True), "snapkv", 6,
                      {"recent": 3, "observe": 4, "pool": 3, "shared": True}),
    "h2o_decay": (h2o_kv.H2O(heavy=3, recent=2, decay=0.8), "h2o", 5, {"recent": 2, "decay": 0.8}),
    "h2o_normalize": (h2o_kv.H2O(heavy=3, recent=2, normalize=True), "h2o", 5, {"recent": 2, "normalize": True}),
    "sinks_h2o": (h2o_kv.Sinks(h2o_kv.H2O(heavy=3, recent=2), sinks=2), "h2o", 5, {"recent": 2, "protect": 2}),
    "sinks_tova": (h2o_kv.Sinks(h2o_kv.TOVA(budget=4), sinks=1), "tova", 4, {"protect": 1}),
    "sinks_snapkv": (h2o_kv.Sinks(h2o_kv.SnapKV(budget=6, window=4, pool=3), sinks=1), "snapkv", 6,
                     {"recent": 3, "observe": 4, "pool": 3, "protect": 1}),
    "adakv_snapkv": (h2o_kv.AdaKV(h2o_kv.SnapKV(budget=6, window=4, pool=3)), "snapkv", 6,
                     {"recent": 3, "observe": 4, "pool": 3, "pooled": True}),
    "adakv_h2o": (h2o_kv.AdaKV(h2o_kv.H2O(heavy=3, recent=2)), "h2o", 5, {"recent": 2, "pooled": True}),
    "adakv_tova": (h2o_kv.AdaKV(h2o_kv.TOVA(budget=4)), "tova", 4, {"pooled": True}),
    "adakv_sinks_h2o": (h2o_kv.AdaKV(h2o_kv.Sinks(h2o_kv.H2O(heavy=3, recent=2), sinks=2)), "h2o", 5,
                        {"recent": 2, "protect": 2, "pooled": True}),
}  # fmt: skip
BEYOND_SCHEDULES = {
    "token_by_token": [1] * 16,
    "one_call": [16],
    "mixed": [7, 1, 1, 5, 1, 1],
    "prompt_then_decode": [12, 1, 1, 1, 1],
}


def causal_mask(real: torch.Tensor) -> torch.Tensor:
    """[B, 1, n, n] boolean mask as transformers builds it for the new tokens of one call."""
    n = real.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=real.device).tril()
    return (causal[None] & real[:, None, :])[:, None]


def run_layer(policy, q, k, v, chunks, *, real=None, mode="drop", prefill_chunk=None, window=None, native=False,
              headroom=0):  # fmt: skip
    """Drive one cache layer the way a model's attention does: update, then attention (`native`: with
    h2o-kv's C++ kernels, as a KVCache on a CPU where they can be built)."""
    settings = Settings(policy, mode, prefill_chunk, compile_kernel=native, headroom=headroom)
    layer = (PooledKVLayer if policy.head_pooled else KVLayer)(settings, 0)
    batch, total = q.shape[0], q.shape[2]
    real = torch.ones(batch, total, dtype=torch.bool, device=q.device) if real is None else real
    outs, start = [], 0
    for size in chunks:
        stop = start + size
        layer.update(k[:, :, start:stop], v[:, :, start:stop])
        out = layer.forward_attention(
            q[:, :, start:stop], causal_mask(real[:, start:stop]), scaling=q.shape[-1] ** -0.5, window=window
        )
        outs.append(out)
        assert int(layer.kept().max()) <= max(layer.max_capacity or 10**9, 0)
        start = stop
    return torch.cat(outs, dim=1), layer


def kept_positions(layer, row: int = 0) -> list[list[int]]:
    pos = layer.pos[row]
    if layer.head is not None:  # a head-pooled layer: one row, each slot tagged with its KV head
        tags = layer.head[row, 0]
        return [sorted(int(p) for p in pos[0][(tags == h) & (pos[0] >= 0)]) for h in range(layer.kv_heads)]
    return [sorted(int(p) for p in head[head >= 0]) for head in pos]


def random_qkv(batch=1, total=16, q_heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, total, dim, generator=gen) * 2
    k = torch.randn(batch, kv_heads, total, dim, generator=gen) * 2
    v = torch.randn(batch, kv_heads, total, dim, generator=gen)
    return q, k, v


BIG = [
    h2o_kv.Full(),
    h2o_kv.H2O(heavy=32, recent=32),
    h2o_kv.Local(window=64),
    h2o_kv.StreamingLLM(sinks=4, window=60),
    h2o_kv.TOVA(budget=64),
    h2o_kv.AdaKV(h2o_kv.SnapKV(budget=64)),
    h2o_kv.AdaKV(h2o_kv.TOVA(budget=64)),  # a head-pooled prompt that scores its last query (batch of 2)
]


SMALL = [
    h2o_kv.H2O(heavy=4, recent=4),
    h2o_kv.Local(window=8),
    h2o_kv.StreamingLLM(sinks=2, window=6),
    h2o_kv.TOVA(budget=8),
    h2o_kv.KeyDiff(budget=8, recent=2),
    h2o_kv.AdaKV(h2o_kv.H2O(heavy=4, recent=4)),
    h2o_kv.AdaKV(h2o_kv.SnapKV(budget=8, window=4, pool=3)),
]


def decode(model, ids, cache, prefill: int, attention_mask=None):
    """Prefill `prefill` columns in one call, then feed the rest one by one; logits of every column."""
    logits = []
    with torch.no_grad():
        for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]:
            mask = None if attention_mask is None else attention_mask[:, :stop]
            out = model(ids[:, start:stop], attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def check_left_padded_batch(model, policy, atol: float = 5e-5) -> None:
    """A batch of a long and a left-padded short prompt generates what each does alone (on the model's device)."""
    device = model.device
    long, short = random_ids(1, 24, seed=2).to(device), random_ids(1, 15, seed=3).to(device)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 9, dtype=torch.long, device=device), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :9] = 0
    kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        both = model.generate(batch, attention_mask=mask, past_key_values=h2o_kv.KVCache(policy), **kw)
        alone = [model.generate(x, past_key_values=h2o_kv.KVCache(policy), **kw) for x in (long, short)]
    for row, single in enumerate(alone):
        assert torch.equal(both.sequences[row, -12:], single.sequences[0, -12:])
        for step_b, step_s in zip(both.scores, single.scores):
            torch.testing.assert_close(step_b[row], step_s[0], atol=atol, rtol=1e-4)


def slots(batch, kv_heads, new_from, n, extra, dim, dtype, seed=0):
    """Storage with `new_from` old tokens, `n` new ones in order after them and `extra` empty slots."""
    gen = torch.Generator().manual_seed(seed)
    total = new_from + n + extra
    keys = torch.randn(batch, kv_heads, total, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, total, dim, generator=gen).to(dtype)
    pos = torch.full((batch, kv_heads, total), -1)
    pos[..., : new_from + n] = torch.arange(new_from + n)
    return keys, values, pos


INT8_TOLERANCE = dict(atol=2e-2, rtol=2e-2)  # logits of the tiny models are O(1); int8 steps are 1/254 of a token's max


@contextmanager
def no_cyclic_collector() -> Iterator[Callable[[], list[str]]]:
    """Python's cyclic collector off and no autograd graph (a model's outputs would hold the keys they were computed
    from), as in `generate`, the engine and the studies: what is freed inside is freed by reference counts alone.
    Yields a function naming the caches and cache layers made inside that Python still tracks (garbage not yet
    collected among them); those of other tests, still held, do not count."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    before = {id(o) for o in _caches()}
    try:
        with torch.no_grad():
            yield lambda: [type(o).__name__ for o in _caches() if id(o) not in before]
    finally:
        if was:
            gc.enable()


def _caches() -> list:
    return [o for o in gc.get_objects() if isinstance(o, (h2o_kv.KVCache, KVLayer))]

"""Rows kept in place (`KVCache.reserve_rows`, `write_rows(into=)`, `release_rows`): a sequence joins a free row and
leaves its row free without moving any other row's storage, and every sequence decodes as it would alone."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.generation import decode_step, prefill

from conftest import make_model, random_ids
from helpers import kept_positions

PROMPTS = (12, 20, 16)  # lengths: with a fraction budget, each row its own capacity
STEPS = 12


def storage(cache: h2o_kv.KVCache) -> list[int]:
    """The addresses of every layer's storage tensors: equal before and after, nothing was reallocated."""
    names = ("keys", "values", "pos", "score", "key_scale", "value_scale", "capacity", "next_pos", "vacant_buffer")
    return [getattr(la, n).data_ptr() for la in cache.layers for n in names if getattr(la, n) is not None]


def solo(model, policy, ids, steps, **kw):
    """One sequence alone: its logits at each step and its kept positions after `steps` steps."""
    cache = h2o_kv.KVCache(policy, **kw)
    token, logits = prefill(model, cache, ids).argmax(-1), []
    for i in range(steps):
        logits.append(decode_step(model, cache, token, torch.tensor([ids.shape[1] + i]))[0])
        token = logits[-1].argmax(-1).view(1)
    return logits, [kept_positions(layer) for layer in cache.layers]


@pytest.mark.filterwarnings("ignore:H2O.budget=0.5. keeps")
@pytest.mark.parametrize("native,kv_dtype", [(False, None), (True, None), (False, "int8")])
def test_join_and_leave_in_place_equal_solo_runs(native, kv_dtype):
    """Sequence a decodes in a 4-row cache (3 free rows); b joins row 2 after 2 steps; a leaves after 5 and c
    joins its row. No storage tensor is reallocated after the first join (the storage already as wide as the
    capacities need), free rows keep at most one token per KV head, the steady step runs with free rows (its
    `steady_key` the same before and after c's join), and each sequence's logits and kept tokens equal its solo
    run's."""
    model = make_model("llama")
    policy, kw = h2o_kv.H2O(budget=0.5), dict(compile_kernel=native, kv_dtype=kv_dtype)
    ids = [random_ids(1, n, seed=i) for i, n in enumerate(PROMPTS)]
    schedule = {"a": (0, 5), "b": (2, STEPS), "c": (5, STEPS)}  # (joins before step, leaves after step)
    rows = {"a": 0, "b": 2, "c": 0}
    alone = {name: solo(model, policy, ids[i], hi - lo, **kw) for i, (name, (lo, hi)) in enumerate(schedule.items())}
    caches = {name: h2o_kv.KVCache(policy, **kw) for name in schedule}
    firsts = {name: prefill(model, caches[name], ids[i]).argmax(-1) for i, name in enumerate(schedule)}
    batch = caches["a"]
    batch.reserve_rows(4)
    tokens, positions = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    got = {name: [] for name in schedule}
    addresses, steady, keys = None, [], []
    with torch.inference_mode():
        for step in range(STEPS):
            for i, (name, (lo, hi)) in enumerate(schedule.items()):
                row = rows[name]
                if step == lo:
                    if name != "a":
                        assert batch.write_rows(caches[name], into=row) == range(row, row + 1)
                    tokens[row], positions[row] = firsts[name], PROMPTS[i]
                if step == hi:
                    batch.release_rows([row])
                    tokens[row] = positions[row] = 0
                    free = [kept_positions(layer, row) for layer in batch.layers]
                    assert all(len(head) == 0 for layer in free for head in layer)
            if step == 3:
                addresses = storage(batch)
            if step >= 3:
                assert storage(batch) == addresses
            steady.append(batch.steady)
            keys.append(batch.steady_key())
            logits = decode_step(model, batch, tokens, positions)
            for name, (lo, hi) in schedule.items():
                if lo <= step < hi:
                    got[name].append(logits[rows[name]])
            tokens, positions = logits.argmax(-1), positions + 1
    for name in schedule:
        torch.testing.assert_close(torch.stack(got[name]), torch.stack(alone[name][0]), atol=1e-4, rtol=1e-4)
    assert [kept_positions(layer, 2) for layer in batch.layers] == alone["b"][1]
    assert [kept_positions(layer, 0) for layer in batch.layers] == alone["c"][1]
    free = [kept_positions(layer, 1) for layer in batch.layers]  # never used: one token per KV head at most
    assert all(len(head) <= 1 for layer in free for head in layer)
    assert steady[-1] and sum(steady) >= 6  # free rows do not keep the layers off the steady step
    # what a captured step depends on: unchanged by c's join into a's freed row, and the step after the join steady
    # (the join keeps the other rows' freed slots and puts c's next token in its first empty one), so a captured step
    # replays through a join; a C++ step leaves its freed slots in a new tensor, so on a CPU's kernels the key
    # changes every step
    assert keys[4] is not None and (native or all(key == keys[4] for key in keys[5:]))

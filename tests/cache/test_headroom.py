"""`KVCache(headroom=N)`: once the prompt is complete, each (sequence, KV head) holds N tokens past its budget, so a
question and its answer after a compressed context join it without evicting any of it (as kvpress appends them);
past that, eviction goes on at budget + N. Against the literal reference (docs/eviction.md) and through a model."""

from __future__ import annotations

import pytest
import torch

import h2o_kv

from conftest import make_model, random_ids
from helpers import BEYOND, kept_positions, random_qkv, run_layer
from reference import reference_layer

CASES = {
    "h2o": (h2o_kv.H2O(heavy=3, recent=2), "h2o", 5, {"recent": 2}),
    "tova": (h2o_kv.TOVA(budget=4), "tova", 4, {}),
    "snapkv": BEYOND["snapkv"],
    "adakv_h2o": BEYOND["adakv_h2o"],
}
SCHEDULES = {"prompt_then_decode": [12, 1, 1, 1, 1], "mixed": [7, 1, 1, 5, 1, 1], "token_by_token": [1] * 16}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("headroom", [0, 2, 6])
def test_headroom_matches_the_reference(name, schedule, headroom):
    policy, rule, capacity, params = CASES[name]
    q, k, v = random_qkv(seed=11)
    chunks = SCHEDULES[schedule]
    out, layer = run_layer(policy, q, k, v, chunks, headroom=headroom)
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], chunks, rule, capacity, params | {"headroom": headroom})
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


def test_a_question_after_a_compressed_context_evicts_none_of_it():
    """A context compressed to 6 tokens per head, `end_prompt()`, a 5-token question and 3 answer tokens within a
    headroom of 8: every context token kept stays, in the cache and in its forks; then one more token evicts."""
    model, ids = make_model("llama"), random_ids(1, 40, seed=3)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3), headroom=8)
    with torch.no_grad():
        model(ids[:, :24], past_key_values=cache, use_cache=True)
        cache.end_prompt()
        context = [kept_positions(layer) for layer in cache.layers]
        assert all(len(head) == 6 for heads in context for head in heads)
        fork = cache.fork()
        for one in (fork, cache):
            model(ids[:, 24:29], past_key_values=one, use_cache=True)  # the question
            for t in range(29, 32):  # the answer
                model(ids[:, t : t + 1], past_key_values=one, use_cache=True)
            now = [kept_positions(layer) for layer in one.layers]
            for before, after in zip(context, now, strict=True):
                assert all(set(b) <= set(a) and len(a) == 14 for b, a in zip(before, after, strict=True))
        model(ids[:, 32:33], past_key_values=cache, use_cache=True)
    assert cache.kept_tokens == 14  # budget + headroom: eviction goes on there
    assert fork.settings.headroom == 8


def test_without_headroom_the_question_evicts_the_context():
    model, ids = make_model("llama"), random_ids(1, 40, seed=3)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3))
    with torch.no_grad():
        model(ids[:, :24], past_key_values=cache, use_cache=True)
        cache.end_prompt()
        model(ids[:, 24:29], past_key_values=cache, use_cache=True)
    assert cache.kept_tokens == 6 and max(max(h) for h in kept_positions(cache.layers[0])) == 28


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_headroom_must_be_a_count_of_tokens(bad):
    with pytest.raises(ValueError, match="headroom must be an int of tokens"):
        h2o_kv.KVCache(h2o_kv.H2O(budget=8), headroom=bad)

"""What a cache reports about its memory: `nbytes()` is what it has allocated (slots reserved ahead included),
`kept_nbytes()` what its kept tokens take; the engine reports both per request, and compares on one measure."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.engine import Engine

from conftest import make_model, random_ids

# per kept token, per layer of the tiny llama (2 KV heads of 16, float32): keys and values, position, score
PER_TOKEN = 2 * (2 * 16 * 4) + 2 * 8 + 2 * 4


@pytest.mark.parametrize("policy,kept", [(h2o_kv.Full(), 37), (h2o_kv.H2O(heavy=4, recent=4), 8)],
                         ids=["full", "h2o"])  # fmt: skip
def test_kept_bytes_count_the_kept_tokens_and_allocated_bytes_the_storage(policy, kept):
    model, cache = make_model("llama"), h2o_kv.KVCache(policy)
    with torch.no_grad():
        model(random_ids(1, 37), past_key_values=cache, use_cache=True)
    layers = len(cache.layers)
    assert cache.kept_tokens == kept
    assert cache.kept_nbytes() == layers * kept * PER_TOKEN
    assert cache.nbytes() >= cache.kept_nbytes()
    if isinstance(policy, h2o_kv.Full):  # its storage reserves slots ahead of a growing prompt
        assert cache.nbytes() > cache.kept_nbytes()


def test_the_engine_reports_each_requests_kept_and_allocated_bytes(tokenizer):
    from serve_helpers import tiny_model

    engine = Engine(tiny_model(tokenizer), tokenizer, max_batch=2, policy="h2o", budget=8)
    requests = [engine.submit(random_ids(1, n)[0].tolist(), max_tokens=2) for n in (30, 12)]
    engine.run()
    for request in requests:
        stats = request.cache_stats
        assert 0 < stats["kv_kept_bytes"] <= stats["kv_bytes"]


@pytest.mark.parametrize("policy", [h2o_kv.H2O(budget=6), h2o_kv.Full()], ids=["h2o", "full"])
def test_allocated_bytes_follow_every_change_of_the_storage(policy):
    """`nbytes()` is summed again only after the cache's `version` moved; it equals the layers' own sum after every
    change: prompts and decode steps, rows reserved, written, freed in place, packed, a fork, and a reset."""
    from h2o_kv.runtime.generation import decode_step, prefill

    model = make_model("llama")

    def allocated(cache) -> int:
        return sum(layer.nbytes() for layer in cache.layers if layer.is_initialized)

    def one(n: int, seed: int):
        cache = h2o_kv.KVCache(policy)
        prefill(model, cache, random_ids(1, n, seed=seed))
        return cache

    with torch.no_grad():
        cache = one(20, 0)
        versions = [cache.version]
        checks = [lambda: None, lambda: decode_step(model, cache, torch.tensor([5]), torch.tensor([20]))]
        if cache.rows_in_place:
            checks += [lambda: cache.reserve_rows(4), lambda: cache.write_rows(one(31, 1), into=2),
                       lambda: cache.release_rows([0]), lambda: cache.select_rows([2])]  # fmt: skip
        else:
            checks += [lambda: cache.write_rows(one(31, 1)), lambda: cache.free_rows([0])]
        for change in checks:
            change()
            versions.append(cache.version)
            assert cache.nbytes() == allocated(cache) > 0
        assert versions == sorted(versions) and len(set(versions)) == len(versions) - 1  # all but the no-op moved
        assert cache.fork().nbytes() == allocated(cache)
        for layer in cache.layers:
            layer.reset()
        assert cache.nbytes() == 0

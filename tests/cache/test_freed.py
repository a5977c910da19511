"""A cache let go frees its keys and values at once: nothing in it refers back to it, so its reference count, not
Python's cyclic collector (whose full pass may not run for hours in a process that makes few Python objects), frees
it. A cache that was a reference cycle held a long study's every prefill until such a pass."""

from __future__ import annotations

import weakref

import pytest

import h2o_kv
from h2o_kv.runtime.generation import decode_step, prefill

from conftest import make_tokenizer, random_ids
from helpers import no_cyclic_collector

POLICIES = {
    "full": lambda: h2o_kv.KVCache(h2o_kv.Full()),
    "h2o": lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=6, recent=6)),
    "adakv": lambda: h2o_kv.KVCache(h2o_kv.AdaKV(h2o_kv.SnapKV(budget=10))),  # head-pooled layers
    "h2o-int8": lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=6, recent=6), kv_dtype="int8"),
    "chunked": lambda: h2o_kv.KVCache(h2o_kv.SnapKV(budget=10), prefill_chunk=16),
}


@pytest.mark.parametrize("name", POLICIES)
def test_a_cache_and_its_fork_are_freed_when_let_go(llama, name) -> None:
    ids = random_ids(2, 40, seed=4)
    with no_cyclic_collector():
        cache = POLICIES[name]()
        logits = prefill(llama, cache, ids)
        twin = cache.fork([1])
        decode_step(llama, twin, logits[1:].argmax(-1), random_ids(1, 1).fill_(40))
        alive = [weakref.ref(cache), weakref.ref(twin), weakref.ref(cache.layers[0].keys)]
        del cache, twin
        assert [ref() is None for ref in alive] == [True, True, True]


def test_a_kvzip_cache_is_freed_when_let_go(llama) -> None:
    """KVzip's pass (`h2o_kv.compress`): its reconstruction state goes with the cache."""
    ids = random_ids(1, 40, seed=5)
    with no_cyclic_collector():
        cache = h2o_kv.compress(llama, ids, h2o_kv.KVzip(budget=10), tokenizer=make_tokenizer(), chunk=16)
        alive = [weakref.ref(cache), weakref.ref(cache.layers[0].keys)]
        del cache
        assert [ref() is None for ref in alive] == [True, True]

"""The engine with rows in place (`Engine(rows_in_place=True)`, the default on a GPU): requests join free rows of a
bucket and leave their rows free, nobody's storage is copied for it, each request's output is its solo run's, and
admission counts the bytes the buckets allocate."""

from __future__ import annotations

import pytest

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.batch import bucket
from h2o_kv.runtime.engine import Engine

from conftest import make_model, make_tokenizer, random_ids

SPECS = [dict(policy="h2o", budget=0.3), dict(policy="snapkv", budget=0.5), dict(policy="full")]


def prompt(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


def test_buckets():
    assert [bucket(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert bucket(5, 6) == 6 and bucket(7, 6) == 7
    assert [bucket(n, 16, tight=True) for n in (1, 3, 5, 9)] == [1, 3, 5, 9]


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_requests_join_and_leave_rows_in_place_and_equal_solo_runs(monkeypatch, kv_dtype):
    """Ten requests of different lengths and max_tokens, most of one policy, at most four running: later ones join
    rows that earlier ones freed. Every bounded policy's joins write into a free row (no `append_rows`, no
    `free_rows`: no other row's storage copied), and every request's tokens equal its solo run's."""
    calls = {"append_rows": 0, "free_rows": 0, "into": 0}
    for name in ("append_rows", "free_rows"):
        original = getattr(KVCache, name)
        monkeypatch.setattr(KVCache, name, lambda self, *a, _f=original, _n=name: calls.__setitem__(_n, calls[_n] + 1)
                            or _f(self, *a))  # fmt: skip
    write_rows = KVCache.write_rows
    monkeypatch.setattr(KVCache, "write_rows", lambda self, other, into=None: calls.__setitem__("into", calls["into"]
                        + (into is not None)) or write_rows(self, other, into))  # fmt: skip
    engine = Engine(make_model("llama"), make_tokenizer(), max_batch=4, prefill_chunk=16, kv_dtype=kv_dtype,
                    rows_in_place=True)  # fmt: skip
    requests = [(prompt(12 + 2 * i, seed=i), 8 + 3 * (i % 4), SPECS[i % 5 == 4]) for i in range(10)]
    solo = [engine.generate(ids, max_tokens=n, **spec).token_ids for ids, n, spec in requests]
    calls.update(append_rows=0, free_rows=0, into=0)
    handles = [engine.submit(ids, max_tokens=n, **spec) for ids, n, spec in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert calls["into"] >= 5 and calls["append_rows"] == calls["free_rows"] == 0
    assert engine.kv_bytes_in_use() == 0 and engine.stats()["running"] == 0


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
def test_every_policy_joins_in_place_and_equals_solo_runs(monkeypatch):
    """Three requests of each of test_engine's policies (Full's rows packed, the others in place; AdaKV's head-pooled
    rows, TOVA's `last`, per-layer budgets), submitted together: each request's tokens equal its solo run's."""
    from test_engine import SPECS

    joins = []
    write_rows = KVCache.write_rows
    monkeypatch.setattr(KVCache, "write_rows", lambda self, other, into=None: joins.append(into) or write_rows(self,
                        other, into))  # fmt: skip
    engine = Engine(make_model("llama"), make_tokenizer(), max_batch=16, prefill_chunk=16, rows_in_place=True)
    requests = [(prompt(10 + 3 * i, seed=i), 16 + 3 * (i % 3), SPECS[i // 3]) for i in range(3 * len(SPECS))]
    solo = [engine.generate(ids, max_tokens=n, **spec).token_ids for ids, n, spec in requests]
    joins.clear()
    handles = [engine.submit(ids, max_tokens=n, **spec) for ids, n, spec in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert sum(into is not None for into in joins) >= 10


def test_an_unbounded_policy_keeps_its_rows_packed():
    """Full's rows are never in place (a free row would grow without bound): the engine batches them as on a
    CPU, with the same outputs as solo runs."""
    engine = Engine(make_model("llama"), make_tokenizer(), max_batch=4, prefill_chunk=16, rows_in_place=True)
    requests = [(prompt(10 + 4 * i, seed=i), 4 + i) for i in range(4)]
    solo = [engine.generate(ids, max_tokens=n, policy="full").token_ids for ids, n in requests]
    handles = [engine.submit(ids, max_tokens=n, policy="full") for ids, n in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
def test_admission_counts_the_bytes_a_bucket_allocates():
    """What admission projects for the running requests covers the bytes their caches allocate, free rows of a
    bucket included (three rows running in a bucket of four), at every step; under a kv_memory limit the caches
    never pass it, and every request finishes."""
    model, tokenizer = make_model("llama"), make_tokenizer()
    requests = [(prompt(16 + 4 * i, seed=i), 12 - i) for i in range(6)]
    engine = Engine(model, tokenizer, max_batch=16, prefill_chunk=32, policy="h2o", budget=0.5, rows_in_place=True)
    handles = [engine.submit(ids, max_tokens=n) for ids, n in requests]
    peak = 0
    while engine.step():
        peak = max(peak, engine.kv_bytes_in_use())
        assert engine.kv_bytes_in_use() <= engine._runs.projected() == engine.stats()["kv_bytes_reserved"]
    assert engine.stats()["running_peak"] >= 3
    limit = peak * 2 // 3
    engine = Engine(model, tokenizer, max_batch=16, prefill_chunk=32, policy="h2o", budget=0.5, rows_in_place=True,
                    kv_memory=limit)  # fmt: skip
    handles = [engine.submit(ids, max_tokens=n) for ids, n in requests]
    while engine.step():
        assert engine.kv_bytes_in_use() <= limit
    assert all(h.result().finish_reason in ("length", "stop") for h in handles)


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
def test_a_bucket_that_would_not_fit_the_kv_memory_is_just_the_rows_in_use():
    """Eight requests of one policy and size under a KV memory that holds six rows and the prompts going in, not a
    bucket of eight: six decode together in a tight bucket of six (power-of-two buckets ran four at a time), the caches
    never pass the limit nor what admission projected, and every request's tokens equal its solo run's."""
    model, tokenizer = make_model("llama"), make_tokenizer()
    requests = [prompt(40, seed=i) for i in range(8)]
    engine = Engine(model, tokenizer, max_batch=16, prefill_chunk=64, policy="h2o", budget=0.5, rows_in_place=True)
    solo = [engine.generate(ids, max_tokens=10).token_ids for ids in requests]
    count = engine._count
    decode, going_in = count.slots(engine.resolve_policy(), 40, 10)
    limit = (6 * decode + 2 * going_in) * count.layout
    engine = Engine(model, tokenizer, max_batch=16, prefill_chunk=64, policy="h2o", budget=0.5, rows_in_place=True,
                    kv_memory=limit)  # fmt: skip
    handles = [engine.submit(ids, max_tokens=10) for ids in requests]
    rows = set()
    while engine.step():
        assert engine.kv_bytes_in_use() <= engine._runs.projected() <= limit
        rows |= {batch.cache.batch_size for batch in engine._runs.batches.values()}
    assert [h.result().token_ids for h in handles] == solo
    assert engine.peaks["running"] == 6 and 6 in rows and 8 not in rows

"""`CapturedSteps` (captured.py): when a batch's decode step is recorded and when it is replayed, checked on a CPU
with a stand-in for CUDA graphs (each replay runs the step again). The graphs themselves run on a GPU
(the last test here, and compare/gpu/check_issue51.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from h2o_kv.backends import native
from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.captured import CapturedSteps
from h2o_kv.runtime.engine import Engine

from conftest import make_model, make_tokenizer, random_ids


class Rerun:
    """Records nothing: a replay runs the step eagerly into the recording's output; notes each recording's cache and
    bucket (rows)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, int]] = []

    def record(self, step, cache):
        self.records.append((id(cache), cache.batch_size))
        out = step()
        return (lambda: out.copy_(step())), out


def prompt(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
@pytest.mark.parametrize("policy", ["h2o", "adakv", "kvzipwindow"])
def test_a_batch_is_recorded_once_per_bucket_and_replayed_across_joins_and_leaves(monkeypatch, policy):
    """Ten requests, at most four running, rows in place, on the torch steps a GPU runs (no C++ kernels): a batch's
    step is recorded once per bucket it reaches (requests joining free rows and leaving them replay the same
    recording), most steady steps are replays, and every request's tokens equal its eager solo run's. AdaKV's
    head-pooled rows too, and serve's default, whose whole-cache rows join one batch with their layers apart."""
    monkeypatch.setattr(native, "resolve", lambda compile_kernel: False)
    model, tokenizer = make_model("llama"), make_tokenizer()
    requests = [(prompt(12 + 2 * i, seed=i), 8 + 3 * (i % 4)) for i in range(10)]
    eager = Engine(model, tokenizer, max_batch=4, prefill_chunk=16, policy=policy, budget=0.3)
    solo = [eager.generate(ids, max_tokens=n).token_ids for ids, n in requests]
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk=16, policy=policy, budget=0.3, rows_in_place=True)
    graphs = Rerun()
    engine._steps = steps = CapturedSteps(model, eos=engine.eos, prefill_chunk=16, held=engine._note_peaks,
                                          graphs=graphs)  # fmt: skip
    handles = [engine.submit(ids, max_tokens=n) for ids, n in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert steps.captured == len(graphs.records) >= 1
    # never twice for one batch and bucket, kvzipwindow too: its passes take steps of their own, and the prompts in
    # them count as rows in use of its batch (`Batch`'s `coming`), which does not fall to one row meanwhile
    assert len(set(graphs.records)) == len(graphs.records)
    assert steps.replayed >= 5 * steps.captured


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
def test_a_batch_filling_with_mixed_budgets_replays_through_its_joins(monkeypatch):
    """A served burst (compare/gpu/serving_run.py's shape, small): twelve prompts of 20-130 tokens submitted at once,
    each its own 30 % capacity, joining one batch as their prompts finish. The batch takes the bucket and the width
    its coming prompts need when it starts (no storage grown later, so one recording), and a join keeps the step
    steady (the other rows' freed slots kept), so the decode calls that are not replays are the first bucket's
    few (not steady, warm-up, recording), not one eager step of the whole batch per join; tokens equal solo runs."""
    monkeypatch.setattr(native, "resolve", lambda compile_kernel: False)
    model, tokenizer = make_model("llama"), make_tokenizer()
    requests = [(prompt(20 + 10 * i, seed=i), 12) for i in range(12)]
    eager = Engine(model, tokenizer, max_batch=16, prefill_chunk=16, policy="h2o", budget=0.3)
    solo = [eager.generate(ids, max_tokens=n, ignore_eos=True).token_ids for ids, n in requests]
    engine = Engine(model, tokenizer, max_batch=16, prefill_chunk=16, policy="h2o", budget=0.3, rows_in_place=True)
    graphs = Rerun()
    engine._steps = steps = CapturedSteps(model, eos=engine.eos, prefill_chunk=16, held=engine._note_peaks,
                                          graphs=graphs)  # fmt: skip
    calls, decode_call = [], CapturedSteps._decode_call

    def counted(self, cache, tokens, positions):
        before = self.replayed
        out = decode_call(self, cache, tokens, positions)
        calls.append(self.replayed > before)
        return out

    monkeypatch.setattr(CapturedSteps, "_decode_call", counted)
    handles = [engine.submit(ids, max_tokens=n, ignore_eos=True) for ids, n in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert len(graphs.records) == len(set(graphs.records)) == steps.captured  # never twice for a bucket
    # fewer eager calls than joins: no whole-batch eager step per join, nor a recording per wider row
    assert len(calls) >= 40 and calls.count(False) < len(requests)


class GraphLike(Rerun):
    """As a CUDA graph's replay, which runs no Python: the step runs again into the output, and the cache's host-side
    `version` is left where it was."""

    def record(self, step, cache):
        replay, out = super().record(step, cache)

        def silent():
            version = cache.settings.version
            replay()
            cache.settings.version = version

        return silent, out


@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
@pytest.mark.parametrize("policy", ["h2o", "adakv"])
def test_a_replay_after_a_replay_skips_the_steady_key(monkeypatch, policy):
    """Between two replays with no eager call and no row written or freed, the cache's `version` stays, so the engine
    replays without recomputing `steady_key` (which would have found the recording's key each time); a join moves
    it, so the key is checked again; and every request's tokens still equal its eager solo run's. Four requests
    that join at once and decode 40 tokens each: after the joins, every replay but the first follows a replay."""
    monkeypatch.setattr(native, "resolve", lambda compile_kernel: False)
    model, tokenizer = make_model("llama"), make_tokenizer()
    requests = [(prompt(12 + 2 * i, seed=i), 40) for i in range(4)]
    eager = Engine(model, tokenizer, max_batch=4, prefill_chunk=16, policy=policy, budget=0.3)
    solo = [eager.generate(ids, max_tokens=n).token_ids for ids, n in requests]
    engine = Engine(model, tokenizer, max_batch=4, prefill_chunk=16, policy=policy, budget=0.3, rows_in_place=True)
    engine._steps = steps = CapturedSteps(model, eos=engine.eos, prefill_chunk=16, held=engine._note_peaks,
                                          graphs=GraphLike())  # fmt: skip
    keys, calls = [], []  # per decode call: (replayed, its key computed)
    steady_key, decode_call = KVCache.steady_key, CapturedSteps._decode_call
    monkeypatch.setattr(KVCache, "steady_key", lambda self: keys.append(1) or steady_key(self))

    def counted(self, cache, tokens, positions):
        before, now = (self.replayed, len(keys)), steady_key(cache)
        out = decode_call(self, cache, tokens, positions)
        calls.append((self.replayed > before[0], len(keys) > before[1]))
        if calls[-1] == (True, False):  # replayed unkeyed: the key it would have found is the recording's
            assert now == self.recorded[cache].key
        return out

    monkeypatch.setattr(CapturedSteps, "_decode_call", counted)
    handles = [engine.submit(ids, max_tokens=n) for ids, n in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    replays = [keyed for replayed, keyed in calls if replayed]
    assert len(replays) == steps.replayed >= 20
    assert replays.count(False) >= len(replays) - 4  # keyed: the first replay, and one after each join at most


def test_captured_steps_need_a_gpu():
    with pytest.raises(ValueError, match="need a model on a GPU"):
        Engine(make_model("llama"), make_tokenizer(), captured_steps=True)
    assert type(Engine(make_model("llama"), make_tokenizer())._steps).__name__ == "EagerSteps"  # a CPU: eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.filterwarnings("ignore:.* too few for coherent text")
@pytest.mark.parametrize("policy", ["h2o", "adakv", "kvzipwindow"])
def test_on_a_gpu_the_engine_replays_cuda_graphs_with_the_eager_tokens(policy):
    """On a GPU the engine keeps rows in place and replays each batch's recorded step by default: the tokens of the
    same engine with eager steps, most steady steps replayed; the recordings go with their batches. AdaKV's
    head-pooled rows too (their steady step holds no host sync, which a CUDA graph's capture would refuse)."""
    model, tokenizer = make_model("llama").cuda(), make_tokenizer()
    requests = [(prompt(12 + 3 * i, seed=i), 10 + 3 * (i % 4)) for i in range(10)]
    runs = []
    for captured in (False, True):
        engine = Engine(model, tokenizer, max_batch=4, prefill_chunk=16, policy=policy, budget=0.3,
                        captured_steps=captured)  # fmt: skip
        handles = [engine.submit(ids, max_tokens=n, ignore_eos=True) for ids, n in requests]
        engine.run()
        runs.append([h.result().token_ids for h in handles])
    assert runs[1] == runs[0]
    assert engine.rows_in_place and isinstance(engine._steps, CapturedSteps)
    # kvzipwindow too: its batch keeps its bucket while the next prompts are in their passes (the CPU stand-in of
    # this workload reproduces the GPU's counts)
    assert engine._steps.captured >= 1 and engine._steps.replayed >= 3 * engine._steps.captured
    gc.collect()
    assert len(engine._steps.recorded) == 0  # a recording goes with its batch's cache

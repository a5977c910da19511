"""The engine: continuous batching gives each request exactly its solo output, within KV memory."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.engine import Engine
from h2o_kv.runtime.generation import Sampling

from conftest import make_model, make_tokenizer, random_ids
from helpers import no_cyclic_collector

SPECS = [
    dict(policy="h2o", budget=0.2),
    dict(policy="globalkv", budget=0.3),
    dict(policy="full"),
    dict(policy="local", budget=8),
    dict(policy="h2o", budget=12),
    dict(policy="tova", budget=0.5),
    dict(policy="streamingllm", budget=10),
    dict(policy="adakv", budget=0.3),
]


def prompt(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


@pytest.fixture
def engine():
    return Engine(make_model("llama"), make_tokenizer(), max_batch=16, prefill_chunk=16)


def test_full_policy_matches_the_unmodified_model(engine):
    stock = make_model("llama", enable=False)
    ids = prompt(30, seed=3)
    with torch.no_grad():
        expected = stock.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, 30:].tolist()
    got = engine.generate(ids, max_tokens=12, policy="full").token_ids
    assert got[: len(expected)] == expected[: len(got)] and len(got) >= 1


@pytest.mark.parametrize("spec", [dict(policy="h2o", budget=0.2), dict(policy="kvzipwindow", budget=0.3)])
def test_a_finished_request_frees_its_cache_at_once(spec):
    """A server runs for days: a finished request's cache (and a KVzip pass's) is freed by reference counts as it
    leaves, not left for Python's cyclic collector, which runs its full pass rarely in a process of few objects."""
    engine = Engine(make_model("llama"), make_tokenizer(), max_batch=4, prefill_chunk=16, **spec)
    with no_cyclic_collector() as made:
        for seed in range(3):
            assert engine.generate(prompt(50, seed), max_tokens=5).token_ids
        assert made() == []


def test_a_full_default_engine_serves_bounded_requests_at_the_default_budget():
    engine = Engine(make_model("llama"), make_tokenizer(), policy="full")
    assert engine.resolve_policy() == h2o_kv.Full()
    assert engine.resolve_policy("h2o") == h2o_kv.H2O(budget=0.2)
    assert engine.resolve_policy("snapkv", 16) == h2o_kv.SnapKV(budget=16)
    ids = prompt(20, seed=4)
    assert engine.generate(ids, max_tokens=4).token_ids == engine.generate(ids, max_tokens=4, policy="full").token_ids
    with pytest.raises(ValueError, match="needs a budget"):
        Engine(make_model("llama"), make_tokenizer(), policy="full", budget=None).resolve_policy("h2o")


def test_concurrent_requests_equal_solo_runs(engine):
    requests = [(prompt(10 + 7 * i, seed=i), SPECS[i % len(SPECS)]) for i in range(12)]
    solo = [engine.generate(ids, max_tokens=10, **spec).token_ids for ids, spec in requests]
    handles = [engine.submit(ids, max_tokens=10, **spec) for ids, spec in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert engine.kv_bytes_in_use() == 0 and engine.stats()["running"] == 0


def test_sampling_with_a_seed_is_batch_invariant(engine):
    sampling = Sampling(temperature=0.9, top_p=0.9, seed=7)
    ids = prompt(20, seed=5)
    solo = engine.generate(ids, max_tokens=12, sampling=sampling).token_ids
    others = [engine.submit(prompt(15, seed=s), max_tokens=12, sampling=Sampling(0.7, seed=s)) for s in range(3)]
    mine = engine.submit(ids, max_tokens=12, sampling=sampling)
    engine.run()
    assert mine.result().token_ids == solo
    assert all(o.result().completion_tokens >= 1 for o in others)


def test_admission_keeps_kv_bytes_within_kv_memory():
    model, tokenizer = make_model("llama"), make_tokenizer()
    probe = Engine(model, tokenizer)
    one_h2o = probe.kv_bytes_for(200, 16, h2o_kv.policies.build("h2o", 0.2))
    one_full = probe.kv_bytes_for(200, 16, h2o_kv.Full())
    limit = 3 * one_full
    peaks = {}
    for spec in (dict(policy="h2o", budget=0.2), dict(policy="full")):
        engine = Engine(model, tokenizer, kv_memory=limit, max_batch=64, prefill_chunk=256)
        handles = [engine.submit(prompt(200, seed=i), max_tokens=16, **spec) for i in range(24)]
        peak_running = peak_bytes = 0
        while engine.step():
            peak_bytes = max(peak_bytes, engine.kv_bytes_in_use())
            peak_running = max(peak_running, engine.stats()["running"])
            assert engine.stats()["kv_bytes_reserved"] <= limit
        assert all(h.result().finish_reason in ("length", "stop") for h in handles)
        assert peak_bytes <= limit
        # the engine's own high-water marks see inside a step (before finished rows leave)
        stats = engine.stats()
        assert peak_bytes <= stats["kv_bytes_peak"] <= limit and stats["running_peak"] == peak_running
        peaks[spec["policy"]] = peak_running
        engine.reset_peaks()
        assert engine.stats()["kv_bytes_peak"] == engine.stats()["running_peak"] == 0
    assert one_full / one_h2o >= 4
    assert peaks["full"] <= 3 and peaks["h2o"] >= 4 * peaks["full"]


def test_request_larger_than_kv_memory_is_refused_at_submit():
    engine = Engine(make_model("llama"), make_tokenizer(), kv_memory=10_000)
    with pytest.raises(ValueError, match="more than the 10000 allowed"):
        engine.submit(prompt(200, seed=1), max_tokens=8, policy="full")


def test_cancel_frees_rows_at_the_next_step(engine):
    keep = engine.submit(prompt(20, seed=1), max_tokens=30)
    gone = engine.submit(prompt(25, seed=2), max_tokens=30)
    for _ in range(8):
        engine.step()
    assert engine.stats()["running"] == 2
    gone.cancel()
    engine.step()
    assert gone.result().finish_reason == "cancelled" and engine.stats()["running"] == 1
    assert engine.kv_bytes_in_use() > 0
    keep.cancel()
    engine.step()
    assert engine.kv_bytes_in_use() == 0
    assert len(keep.result().token_ids) < 30


def test_a_long_prompt_joins_while_others_keep_decoding(engine):
    running = engine.submit(prompt(10, seed=1), max_tokens=40)
    engine.step()
    engine.step()
    before = len(running.token_ids)
    joining = engine.submit(prompt(160, seed=2), max_tokens=4)  # 10 chunks of 16
    steps = 0
    while not joining.token_ids:
        engine.step()
        steps += 1
    assert steps >= 10  # one chunk per step
    assert len(running.token_ids) - before == steps  # a token every step meanwhile
    engine.run()


def test_a_short_prompt_does_not_wait_behind_a_long_prefill_and_the_long_one_still_advances(engine):
    """FIFO prefill made a reused prefix's few new tokens wait for every long prompt admitted before it; a prompt
    one chunk finishes now goes first, and the oldest prompt still gets its chunk every step."""
    long_ids, short_ids = prompt(160, seed=2), prompt(12, seed=3)
    solo = [engine.generate(ids, max_tokens=4).token_ids for ids in (long_ids, short_ids)]
    long = engine.submit(long_ids, max_tokens=4)  # 10 chunks of 16
    engine.step()
    shorts = []
    for _ in range(4):  # a stream of short prompts, one a step
        shorts.append(engine.submit(short_ids, max_tokens=4))
        engine.step()
        assert shorts[-1].token_ids  # its first token in the step it was admitted
    steps = 5
    while not long.token_ids:
        engine.step()
        steps += 1
    assert steps == 10  # one chunk of the long prompt every step, shorts or not
    engine.run()
    assert long.result().token_ids == solo[0]
    assert all(s.result().token_ids == solo[1] for s in shorts)


def test_stop_strings_end_the_text_before_them():
    engine = Engine(make_model("llama"), make_tokenizer())
    ids = prompt(12, seed=0)
    full = engine.generate(ids, max_tokens=20, policy="full")
    text = full.text
    assert len(text) >= 6, "the tiny model should produce some text"
    stop = text[3:5]
    cut = engine.generate(ids, max_tokens=20, policy="full", stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]


def test_events_stream_the_same_text_from_a_background_thread():
    engine = Engine(make_model("llama"), make_tokenizer())
    engine.start()
    try:
        seen = []
        request = engine.submit(prompt(12, seed=4), max_tokens=10, on_event=seen.append)
        events = list(request.events(timeout=30))
        assert events[-1].finish_reason in ("length", "stop")
        assert "".join(e.text for e in events) == request.result().text
        assert seen == events
    finally:
        engine.shutdown(drain=False, timeout=10)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit([5, 6], max_tokens=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_ids=[]), "empty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(budget=1.5), "means nothing"),
        (dict(policy="lru"), "unknown policy"),
        (dict(policy="full", prompt_ids=list(range(3, 100)) * 25, max_tokens=10), "exceed the model's context"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_requests_are_refused_at_submit(engine, kwargs, message):
    args = dict(prompt_ids=[5, 6, 7], max_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        engine.submit(args.pop("prompt_ids"), **args)
    assert engine.stats()["waiting"] == 0


def test_steps_keep_no_autograd_history(engine):
    request = engine.submit(prompt(12, seed=1), max_tokens=20)
    engine.step()
    engine.step()
    cache = next(iter(engine._runs.batches.values())).cache
    assert not any(layer.keys.requires_grad or layer.keys.grad_fn is not None for layer in cache.layers)
    request.cancel()
    engine.run()


def test_ignore_eos_generates_exactly_max_tokens():
    engine = Engine(make_model("llama"), make_tokenizer())
    ids = prompt(12, seed=4)  # the tiny model ends this one with EOS after a few tokens
    stopped = engine.generate(ids, max_tokens=20, policy="full")
    assert stopped.finish_reason == "stop" and stopped.completion_tokens < 20
    forced = engine.generate(ids, max_tokens=20, policy="full", ignore_eos=True)
    assert forced.finish_reason == "length" and forced.completion_tokens == 20
    assert forced.token_ids[: stopped.completion_tokens] == stopped.token_ids


def test_int8_storage_batches_like_solo_and_stays_within_its_admission_size():
    engine = Engine(make_model("llama"), make_tokenizer(), kv_dtype="int8", prefill_chunk=16)
    requests = [(prompt(20 + 9 * i, seed=i), SPECS[i % 3]) for i in range(6)]
    solo = [engine.generate(ids, max_tokens=8, **spec).token_ids for ids, spec in requests]
    handles = [engine.submit(ids, max_tokens=8, **spec) for ids, spec in requests]
    while engine.step():
        assert engine.kv_bytes_in_use() <= engine.stats()["kv_bytes_reserved"]
    assert [h.result().token_ids for h in handles] == solo
    float32 = Engine(make_model("llama"), make_tokenizer())
    assert engine.kv_bytes_for(100, 8) < 0.5 * float32.kv_bytes_for(100, 8)
    with pytest.raises(ValueError, match="kv_dtype"):
        Engine(make_model("llama"), make_tokenizer(), kv_dtype="int4")


def test_rows_short_of_their_capacity_hold_no_more_than_admission_counted():
    """Requests whose prompt and answer stay under a token budget are admitted by what they can fill (prompt +
    max_tokens + 1 slots per KV head, not the budget); their rows grow no further than that while they decode."""
    engine = Engine(make_model("llama"), make_tokenizer(), policy="h2o", budget=64)
    handles = [engine.submit(prompt(10 + i, seed=i), max_tokens=12, ignore_eos=True) for i in range(4)]
    while engine.step():
        assert engine.kv_bytes_in_use() <= engine.stats()["kv_bytes_reserved"]
    assert all(h.result().completion_tokens == 12 for h in handles)


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token():
    """top_p=5e-324 (found by the server's fuzzer) once masked every token and crashed the sampler."""
    from h2o_kv.runtime.generation import sample

    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    assert sample(logits, Sampling(temperature=1.0, top_p=5e-324)) == int(logits.argmax())
    # a temperature near 0 (also the fuzzer's): logits / t overflowed to inf, and softmax gave NaN probabilities
    assert sample(logits * 1e4, Sampling(temperature=1e-300)) == int(logits.argmax())


def test_a_request_whose_sampling_fails_ends_with_its_error_and_the_engine_goes_on(engine, monkeypatch):
    """A sampler error (here forced for one request's settings) fails that request only: the others, in the same
    decode batch and after it, finish as if it had never been there."""
    from h2o_kv.runtime import steps as steps_module

    real = steps_module.sample

    def failing(logits, sampling, generator=None):
        if sampling.temperature == 0.5:
            raise RuntimeError("invalid multinomial distribution")
        return real(logits, sampling, generator)

    monkeypatch.setattr(steps_module, "sample", failing)
    ids = random_ids(1, 12)[0].tolist()
    alone = engine.submit(ids, max_tokens=6)
    engine.run()
    bad = engine.submit(ids, max_tokens=6, sampling=Sampling(temperature=0.5))
    good = engine.submit(ids, max_tokens=6)
    engine.run()
    with pytest.raises(RuntimeError, match="failed: RuntimeError: invalid multinomial distribution"):
        bad.result()
    assert good.result().token_ids == alone.result().token_ids
    after = engine.submit(ids, max_tokens=6)
    engine.run()
    assert after.result().token_ids == alone.result().token_ids
    assert engine.kv_bytes_in_use() == 0


def test_a_request_admission_could_never_take_is_refused_at_submit_not_left_waiting():
    """Admission projects a prompt going in beside its rows; a request whose projection alone is over kv_memory
    would wait for ever, so submit refuses it, and one whose projection fits exactly runs."""
    from h2o_kv.errors import KVMemoryExceeded

    model, tokenizer = make_model("llama"), make_tokenizer()
    decode_only = Engine(model, tokenizer).kv_bytes_for(120, 6, h2o_kv.Full())
    engine = Engine(model, tokenizer, kv_memory=decode_only)
    with pytest.raises(KVMemoryExceeded, match="its prompt going in, then its rows decoding") as refused:
        engine.submit(prompt(120, seed=1), max_tokens=6, policy="full")
    assert engine.stats()["waiting"] == 0
    fits = Engine(model, tokenizer, kv_memory=refused.value.needed)
    request = fits.submit(prompt(120, seed=1), max_tokens=6, policy="full", ignore_eos=True)
    fits.run()
    assert request.result().completion_tokens == 6

"""The study's shared prefill: one recorded Full prefill replayed into each policy's cache leaves the cache a direct
oneshot prefill leaves (kept positions, keys, values, scores) and decodes the same answers."""

from __future__ import annotations

import pytest
import torch

from h2o_kv.cache.reconstruct import PassPeaks
from h2o_kv.runtime.generation import forward, greedy_continue, greedy_ids
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.shared import (
    SharedAttention,
    held_call,
    record_pass,
    record_prefill,
    replay,
    replay_pass,
    shared_answers,
    shared_greedy,
)

from conftest import make_model, make_tokenizer, random_ids
from helpers import kept_positions, no_cyclic_collector

CONFIGS = [("full", None), ("h2o", 9), ("h2o", 0.2), ("snapkv", 8), ("adakv", 8), ("pyramidkv", 8), ("tova", 7),
           ("streamingllm", 6), ("local", 5)]  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.mark.parametrize(("policy", "budget"), CONFIGS, ids=[f"{p}-{b}" for p, b in CONFIGS])
def test_replayed_cache_equals_a_direct_prefill(llama, policy, budget) -> None:
    ids = random_ids(1, 40, seed=3)
    direct = new_cache(policy, budget, 40)
    with torch.no_grad():
        forward(llama, direct, ids)
    logits, calls = record_prefill(llama, ids[0].tolist())
    replayed = replay(new_cache(policy, budget, 40), calls)
    assert len(replayed.layers) == len(direct.layers) == llama.config.num_hidden_layers
    for a, b in zip(direct.layers, replayed.layers, strict=True):
        assert kept_positions(a) == kept_positions(b)
        assert torch.equal(a.pos, b.pos)
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-6)
        if a.score is not None:
            torch.testing.assert_close(a.score, b.score, rtol=1e-5, atol=1e-6)
    if budget is not None:  # the budget was applied: fewer tokens than the prompt's in every layer
        assert replayed.kept_tokens < 40


def test_a_replay_computes_no_attention_output(llama, monkeypatch) -> None:
    """The outputs of a replay's calls are the recording's: the window and last-query scorers (SnapKV, PyramidKV,
    TOVA) get their scores without the prompt route's SDPA pass over every query (`Call.want_out`), and leave the
    cache a direct prefill leaves (test above)."""
    from h2o_kv.cache import prompt

    calls_made = []
    real = prompt.sdpa
    monkeypatch.setattr(prompt, "sdpa", lambda *a, **k: calls_made.append(1) or real(*a, **k))
    ids = random_ids(1, 40, seed=3)
    _, calls = record_prefill(llama, ids[0].tolist())
    recorded = len(calls_made)  # the recording's own prefill: its outputs are needed
    assert recorded == llama.config.num_hidden_layers
    for policy in ("snapkv", "pyramidkv", "tova"):
        replayed = replay(new_cache(policy, 8, 40), calls)
        assert replayed.kept_tokens < 40 * llama.config.num_hidden_layers
    assert len(calls_made) == recorded


@pytest.mark.parametrize(
    ("policy", "budgets"),
    [("kvzip", (40, 12, 0.25)), ("kvzipwhole", (12, 5)), ("kvzipwindow", (12, 5)), ("kvziplayerwindow", (12, 0.25))],
)
def test_kvzip_pass_recorded_once_leaves_each_cache_as_its_own_pass(llama, policy, budgets) -> None:
    """KVzip's pass recorded once (`record_pass`) and replayed into caches of other budgets and allocations (per
    head, whole cache) leaves each as `h2o_kv.compress` on it does: the same kept positions, keys, values and
    reconstruction scores, bit for bit, and the same capacities (whole cache: each layer's share). At 40 nothing is
    evicted, so every context token's score is compared. The replays share the pass's peak attention, which the
    recording's own run computed: each scoring call of each layer once, and the replays none (per head or pooled)."""
    from h2o_kv.runtime.compress import compress

    tokenizer = make_tokenizer()
    ids = random_ids(1, 40, seed=5)
    peaks = PassPeaks()
    _, calls = record_pass(llama, ids[0].tolist(), tokenizer, chunk=16, peaks=peaks)
    assert all(len(layer) == len(calls[0]) == 4 for layer in calls)  # the held call, then 3 reconstruction calls
    computed = dict(peaks.done)
    assert len(computed) == len(calls) * (len(calls[0]) - 1) and not peaks.outputs  # every scoring call, once
    for budget in budgets:
        direct = compress(llama, ids, cache=new_cache(policy, budget, 40), tokenizer=tokenizer, chunk=16)
        replayed = replay_pass(new_cache(policy, budget, 40), calls, peaks)
        assert peaks.done.keys() == computed.keys()  # nothing computed again
        assert all(peaks.done[key] is peak for key, peak in computed.items())
        assert replayed.kept_tokens == direct.kept_tokens <= 40 * len(direct.layers)
        for a, b in zip(direct.layers, replayed.layers, strict=True):
            assert kept_positions(a) == kept_positions(b)
            for name in ("pos", "keys", "values", "score", "capacity", "head"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None and y is None) or torch.equal(x, y), (policy, budget, name)


def test_replays_sharing_their_attention_leave_each_cache_as_a_replay_alone(llama) -> None:
    """Every policy at two budgets replayed with one `SharedAttention`: the same state as each replayed with its own,
    bit for bit, while the scores asked for are computed once per kind of request and layer (every query's
    attention: H2O; an observation window's: SnapKV, AdaKV's first call, PyramidKV; the last query's: TOVA) and
    StreamingLLM, Local and Full attend not at all."""
    ids = random_ids(1, 40, seed=4)[0].tolist()
    _, calls = record_prefill(llama, ids)
    shared = SharedAttention()
    for policy, budget in CONFIGS + [(p, 12) for p, b in CONFIGS if b is not None]:
        together = replay(new_cache(policy, budget, 40), calls, shared)
        alone = replay(new_cache(policy, budget, 40), calls)
        for a, b in zip(alone.layers, together.layers, strict=True):
            assert torch.equal(a.pos, b.pos), policy
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), policy
            for name in ("score", "last", "head"):
                assert (getattr(a, name) is None) == (getattr(b, name) is None), (policy, name)
                assert getattr(a, name) is None or torch.equal(getattr(a, name), getattr(b, name)), (policy, name)
    layers = llama.config.num_hidden_layers
    assert shared.computed == 4 * layers  # H2O's, SnapKV's (uniform rows), AdaKV's (a head-pooled row), TOVA's


def test_shared_answers_equal_each_policy_run_alone(llama) -> None:
    prompt = random_ids(1, 48, seed=5)[0].tolist()
    configs = CONFIGS + [("h2o-int8", 9)]  # int8 reads the prompt itself (it cannot replay)
    makers = {(p, b): (lambda p=p, b=b: new_cache(p, b, 48)) for p, b in configs}
    shared = shared_greedy(llama, prompt, makers, max_new_tokens=10)
    for (policy, budget), (answer, kv_bytes) in shared.items():
        alone = new_cache(policy, budget, 48)
        assert answer == greedy_ids(llama, alone, prompt, 10), policy
        assert 0 < kv_bytes <= alone.nbytes()
    assert shared[("h2o", 9)][1] < shared[("full", None)][1] / 4  # 9 of 48 tokens (plus bookkeeping)
    full = {"full": makers[("full", None)]}
    stopped = shared_greedy(llama, prompt, full, max_new_tokens=10, done=lambda t: len(t) >= 3)
    assert stopped["full"][0] == shared[("full", None)][0][:3]


def test_kvzip_query_aware_answers_as_its_own_pass(llama) -> None:
    """Query-aware (the question inside the prompt): KVzip's recorded pass covers the whole prompt and the first token
    comes from its held call, as `compress_with_logits` and a served request give it (and kvpress, whose press
    compresses the prompt call that gives the first token); per head and whole cache, from one recording, int8
    storage from a pass of its own."""
    from h2o_kv.runtime.compress import compress_with_logits

    tokenizer = make_tokenizer()
    prompt = random_ids(1, 41, seed=6)[0].tolist()
    makers = {p: (lambda p=p: new_cache(p, 10, 41)) for p in ("kvzip", "kvzipwhole", "kvzip-int8")}
    shared = shared_greedy(llama, prompt, makers, max_new_tokens=8, tokenizer=tokenizer)
    full = shared_greedy(llama, prompt, {"full": lambda: new_cache("full", None, 41)}, max_new_tokens=1)
    for policy in makers:
        alone, logits = compress_with_logits(llama, torch.tensor([prompt]), cache=makers[policy](), tokenizer=tokenizer)
        assert shared[policy][0] == greedy_continue(llama, alone, logits, 41, 8), policy
        assert shared[policy][0][0] == full["full"][0][0]  # the held call's next token is the full prompt's


def test_the_pass_held_call_is_the_prompts_own_and_spares_a_prefill(llama, monkeypatch) -> None:
    """`held_call`: KVzip's recorded pass begins with the prompt's own call, equal call for call to `record_prefill`'s
    (keys, values, queries, mask, options) and with its logits, so a sample with KVzip caches records no prefill of
    its own: every other cache replays the held call, and answers as it does from `record_prefill`."""
    from h2o_kv.studies.eval import shared as shared_module

    tokenizer = make_tokenizer()
    prompt = random_ids(1, 41, seed=7)[0].tolist()
    logits, calls = record_prefill(llama, prompt)
    held_logits, held = held_call(record_pass(llama, prompt, tokenizer, chunk=16))
    assert torch.equal(logits, held_logits) and len(held) == len(calls)
    for (a,), (b,) in zip(calls, held, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4], strict=True)) and a[4] == b[4]
    makers = {
        p: (lambda p=p: new_cache(p, None if p == "full" else 10, 41)) for p in ("full", "h2o", "snapkv", "kvzipwhole")
    }
    alone = {p: shared_greedy(llama, prompt, {p: makers[p]}, max_new_tokens=6, tokenizer=tokenizer)[p] for p in makers}
    monkeypatch.setattr(shared_module, "record_prefill", lambda *a, **k: pytest.fail("a second prefill"))
    together = shared_greedy(llama, prompt, makers, max_new_tokens=6, tokenizer=tokenizer)
    assert together == alone


def test_int8_storage_is_refused(llama) -> None:
    """An int8 cache's prefill attends over its stored (rounded) keys, so it cannot share Full's prefill."""
    _, calls = record_prefill(llama, random_ids(1, 12)[0].tolist())
    with pytest.raises(ValueError, match="int8"):
        replay(new_cache("h2o-int8", 4, 12), calls)


def test_shared_answers_leave_no_cache_behind(llama) -> None:
    """A study runs thousands of samples in one process: once a sample's answers are in, every cache it made (the
    recording, KVzip's pass, each policy's cache and its forks) is freed by reference counts alone, not left for
    Python's cyclic collector, whose rare full pass let a long run's every recorded prefill pile up."""
    tokenizer = make_tokenizer()
    makers = {p: (lambda p=p: new_cache(p, 10, 41)) for p in ("kvzipwhole", "h2o", "snapkv", "h2o-int8")}
    questions = [random_ids(1, 5, seed=s)[0].tolist() for s in (8, 9)]
    with no_cyclic_collector() as made:
        for seed in (10, 11):
            prompt = random_ids(1, 41, seed=seed)[0].tolist()
            answers = shared_answers(llama, prompt, makers, questions, max_new_tokens=4, tokenizer=tokenizer)
            assert all(len(outs) == 2 for outs, _ in answers.values())
        assert made() == []

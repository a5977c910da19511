"""KVzip in the engine: a new request prefills inside its reconstruction pass, one call per step, and answers as the
library's one-cache run (`compress_with_logits`, then greedy steps); a kept prefix's fork runs no pass."""

from __future__ import annotations

import types

import pytest
import torch

import h2o_kv
from h2o_kv.errors import ContextTooLong, KVMemoryExceeded
from h2o_kv.runtime.compress import compress_with_logits, piece_overhead
from h2o_kv.runtime.engine import Engine
from h2o_kv.runtime.generation import decode_step, prefill

from conftest import make_model, make_tokenizer, random_ids

CHUNK = 16
ANSWER = 6
pytestmark = pytest.mark.filterwarnings("ignore:KVzip.*too few for coherent text")  # tiny prompts' fraction budgets


def ids(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


def engine(chunk: int | None = CHUNK, **kwargs) -> Engine:
    return Engine(make_model("llama"), make_tokenizer(), prefill_chunk=chunk, policy="kvzip", budget=0.5, **kwargs)


def greedy(model, cache, logits, start: int, n: int) -> list[int]:
    """`n` greedy tokens from the prompt's last `logits`, the first fed at position `start`."""
    out = [int(logits.argmax(-1))]
    with torch.no_grad():
        while len(out) < n:
            step = torch.tensor([start + len(out) - 1])
            out.append(int(decode_step(model, cache, torch.tensor([out[-1]]), step).argmax(-1)))
    return out


def one_cache(run: Engine, prompt: list[int], policy, n: int = ANSWER, chunk: int = CHUNK, cache=None):
    """The library run: the prompt compressed (its pass's chunk the engine's; into `cache` if given), its first token
    from the held call's logits, then greedy steps on that cache. Returns (tokens, cache)."""
    cache, logits = compress_with_logits(run.model, torch.tensor([prompt]), policy, tokenizer=run.tokenizer,
                                         chunk=chunk, cache=cache)  # fmt: skip
    return greedy(run.model, cache, logits, len(prompt), n), cache


def ask(run: Engine, prompt: list[int], **kwargs):
    request = run.submit(prompt, max_tokens=kwargs.pop("max_tokens", ANSWER), ignore_eos=True, **kwargs)
    run.run()
    return request


@pytest.mark.parametrize("name", ["kvzip", "kvziplayer", "kvziplayerwindow"])  # per KV head; a layer's heads together
@pytest.mark.parametrize(("length", "chunk", "budget"), [(40, 16, 0.5), (33, 16, 12), (12, 16, 0.5), (45, None, 0.3)],
                         ids=["chunks", "one-token-tail", "one-chunk", "whole"])  # fmt: skip
def test_a_kvzip_request_equals_the_library_one_cache_run(length, chunk, budget, name):
    run = engine(chunk, session_memory=2**30)
    prompt, policy = ids(length, seed=length), h2o_kv.policies.build(name, budget)
    tokens, _ = one_cache(run, prompt, policy, chunk=chunk or 512)
    assert ask(run, prompt, policy=policy).token_ids == tokens
    # what the pass kept: a request its first token ends leaves its compressed cache to the store
    assert ask(run, prompt, policy=policy, max_tokens=1).finish_reason == "length"
    _, kept = run.prefixes.checkout(policy, prompt + [0])
    library = compress_with_logits(run.model, torch.tensor([prompt]), policy, tokenizer=run.tokenizer,
                                   chunk=chunk or 512)[0]  # fmt: skip
    assert torch.equal(kept.kept_per_head(), library.kept_per_head())
    mine, theirs = kept.kept_map(0).kept, library.kept_map(0).kept
    agree = (mine == theirs).float().mean().item()  # held chunks round a little differently from one held call
    assert agree == 1.0 if chunk is None else agree >= 0.97
    assert kept.nbytes() <= library.nbytes()  # shrunk to what it keeps


@pytest.mark.parametrize(("mode", "kv_dtype"), [("mask", None), ("drop", "int8")])
def test_mask_mode_and_int8_storage_equal_compress_on_the_same_cache(mode, kv_dtype):
    run = engine(mode=mode, kv_dtype=kv_dtype)
    prompt = ids(40, seed=3)
    assert ask(run, prompt).token_ids == one_cache(run, prompt, None, cache=h2o_kv.KVCache(
        h2o_kv.KVzip(budget=0.5), mode=mode, kv_dtype=kv_dtype))[0]  # fmt: skip
    alone = sum(run._count.slots(run.resolve_policy(), 40, ANSWER)) * run._count.layout  # decoding + going in
    assert run.stats()["kv_bytes_peak"] <= alone


def test_concurrent_kvzip_requests_equal_their_solo_runs_within_kv_memory():
    specs = [(40, dict()), (23, dict(budget=10)), (57, dict()), (12, dict()), (30, dict(policy="h2o", budget=8)),
             (35, dict(policy="kvziplayer", budget=0.4))]  # fmt: skip
    prompts = [(ids(n, seed=n), spec) for n, spec in specs]
    solo_run = engine()
    solo = [ask(solo_run, p, **spec).token_ids for p, spec in prompts]
    library = one_cache(solo_run, prompts[0][0], h2o_kv.KVzip(budget=0.5))[0]
    assert solo[0] == library
    alone = [solo_run._count.slots(solo_run.resolve_policy(spec.get("policy"), spec.get("budget")), len(p), ANSWER)
             for p, spec in prompts]  # fmt: skip
    kv_memory = max(sum(s) for s in alone) * solo_run._count.layout  # the largest alone: the others queue or share
    run = engine(kv_memory=kv_memory)
    requests = [run.submit(p, max_tokens=ANSWER, ignore_eos=True, **spec) for p, spec in prompts]
    while run.step():
        assert run.kv_bytes_in_use() <= kv_memory
    assert [r.token_ids for r in requests] == solo
    stats = run.stats()
    assert 0 < stats["kv_bytes_peak"] <= kv_memory and 1 < stats["running_peak"] < len(prompts)
    assert not run._runs.passes and run.kv_bytes_in_use() == 0


def test_rows_in_place_serve_kvzip_as_packed_rows():
    prompts = [ids(n, seed=n) for n in (40, 23, 31)]
    answers = []
    for in_place in (False, True):
        run = engine(rows_in_place=in_place)
        requests = [run.submit(p, max_tokens=ANSWER, ignore_eos=True) for p in prompts]
        run.run()
        answers.append([r.token_ids for r in requests])
    assert answers[0] == answers[1]


def test_admission_counts_the_held_prompt_and_its_longest_reconstruction_call():
    run = engine()
    policy, length = run.resolve_policy(), 40
    decode, held = run._count.slots(policy, length, ANSWER)
    assert held == length + CHUNK + piece_overhead(run.tokenizer) + 1
    exact = (decode + held) * run._count.layout
    with pytest.raises(KVMemoryExceeded):
        engine(kv_memory=exact - 1).submit(ids(length, seed=1), max_tokens=ANSWER)
    tight = engine(kv_memory=exact)  # admitted alone, and it never holds more than it was admitted by
    assert ask(tight, ids(length, seed=1)).finish_reason == "length"
    assert tight.stats()["kv_bytes_peak"] <= exact


def test_a_prompt_whose_reconstruction_calls_pass_the_context_is_refused():
    """The pass reads positions after the prompt: a prompt that fits the context with its answer but not with its
    longest reconstruction call is refused at submit (ContextTooLong), one short enough is served."""
    run = engine()
    run.context_limit = 200
    longest = run._count.pass_call(150)
    with pytest.raises(ContextTooLong, match="reconstruction call"):
        run.submit(ids(200 - longest + 1, seed=1), max_tokens=ANSWER)
    assert ask(run, ids(200 - run._count.pass_call(100), seed=1)).finish_reason == "length"


@pytest.mark.parametrize("name", ["kvzipwhole", "kvzipwindow"])  # the window's queries span the held chunks
@pytest.mark.parametrize("in_place", [False, True], ids=["packed", "in-place"])
def test_whole_cache_rankings_share_a_batch_where_it_fits_kv_memory(name, in_place):
    """KVzip's own allocation (`kvzipwhole`): each request's pass ranks every head of every layer at once and sizes
    its layers apart. Such requests join one batch (each layer as wide as its widest row's) where that fits
    kv_memory beside everyone else, else each decodes alone: with room they share it, with just the room admission
    counted some go apart; what is held never passes kv_memory, and every answer equals its solo run, the first the
    library's compress run."""
    policy, LONG = h2o_kv.policies.build(name, 0.5), 24
    prompts = [ids(n, seed=n) for n in (40, 31, 47)]
    solo_run = engine()
    solo = [ask(solo_run, p, policy=policy, max_tokens=LONG).token_ids for p in prompts]
    answer, library = one_cache(solo_run, prompts[0], policy, n=LONG)
    assert solo[0] == answer
    assert len({int(n) for n in library.kept_per_head().sum(-1)}) > 1  # the ranking sized the layers unevenly
    alone = [solo_run._count.slots(policy, len(p), LONG) for p in prompts]
    kv_memory = 3 * max(sum(s) for s in alone) * solo_run._count.layout
    run = engine(kv_memory=kv_memory, rows_in_place=in_place)
    requests = [run.submit(p, max_tokens=LONG, ignore_eos=True, policy=policy) for p in prompts]
    widest = 0
    while run.step():
        assert run.kv_bytes_in_use() <= kv_memory and run._runs.projected() <= kv_memory
        widest = max([widest, *(len(b) for b in run._runs.batches.values())])
    assert [r.token_ids for r in requests] == solo and widest == 3  # one batch of the three, their layers apart
    by_name = Engine(make_model("llama"), make_tokenizer(), policy=name, budget=0.5)  # serve --policy
    assert by_name.generate(prompts[1], max_tokens=LONG, ignore_eos=True).token_ids == solo[1]


def test_a_whole_cache_row_decodes_apart_where_the_joined_batch_would_pass_kv_memory(monkeypatch):
    """The join's rule at its boundary: with exactly the bytes the joined batch would make the engine hold
    (`projected`), a whole-cache row joins; with one byte less it decodes in a batch of its own, and answers as
    its solo run."""
    from h2o_kv.runtime.scheduler import Scheduler

    policy, LONG = h2o_kv.policies.build("kvzipwhole", 0.5), 12
    prompts = [ids(n, seed=n) for n in (40, 47)]
    solo = [ask(engine(), p, policy=policy, max_tokens=LONG).token_ids for p in prompts]
    run = engine()
    first, second = [run.submit(p, max_tokens=LONG, ignore_eos=True, policy=policy) for p in prompts]
    held, join = [], Scheduler.join

    def hold_second(self, request, cache, device):  # the second's join is decided below, by hand
        if request is second:
            held.append(cache)
        else:
            join(self, request, cache, device)

    monkeypatch.setattr(Scheduler, "join", hold_second)
    while not held:
        assert run.step()
    runs, cache = run._runs, held[0]
    assert policy in runs.batches and not cache.layers_alike()
    after = runs.batches[policy].cache.joined_nbytes(cache, 2, in_place=False)
    runs.kv_memory = runs.projected(joining=(second, after))
    assert runs._fits_joined(second, cache)
    runs.kv_memory -= 1
    assert not runs._fits_joined(second, cache)
    join(runs, second, cache, run.model.device)
    assert (policy, second.id) in runs.batches and len(runs.batches[policy]) == 1
    monkeypatch.undo()
    run.run()
    assert [first.token_ids, second.token_ids] == solo


@pytest.mark.parametrize("in_place", [False, True], ids=["packed", "in-place"])
def test_a_joined_batch_holds_the_bytes_its_join_was_counted_at(in_place):
    """`KVCache.joined_nbytes`, which decides whether a whole-cache row may join: after the join and a decode step
    the batch holds exactly the bytes it predicted (each layer as wide as `Rows.joined_width`)."""
    policy = h2o_kv.policies.build("kvzipwhole", 0.5)
    run = engine(rows_in_place=in_place)
    caches = [one_cache(run, ids(n, seed=n), policy, n=1)[1] for n in (40, 47)]
    batch, joining = caches
    rows = 2
    if in_place:
        batch.reserve_rows(rows)
    predicted = batch.joined_nbytes(joining, rows, in_place=in_place)
    batch.write_rows(joining, into=1 if in_place else None)
    with torch.no_grad():
        decode_step(run.model, batch, torch.tensor([5, 6]), torch.tensor([40, 47]))
    assert batch.nbytes() == predicted


def test_whole_cache_requests_whose_pass_evicted_nothing_decode_together():
    """`kvzipwhole` requests whose prompts fit the budget lose nothing in their pass, so every layer stays at the
    budget (as admitted): they decode together in their policy's batch, which one whose pass evicted joins too (no
    kv_memory here: the joined batch fits), and every answer equals its solo run."""
    policy, LONG = h2o_kv.policies.build("kvzipwhole", 32), 12
    prompts = [ids(n, seed=n) for n in (10, 14, 20, 45)]  # the last is over the budget: its pass ranks
    solo_run = engine()
    solo = [ask(solo_run, p, policy=policy, max_tokens=LONG).token_ids for p in prompts]
    run = engine()
    requests = [run.submit(p, max_tokens=LONG, ignore_eos=True, policy=policy) for p in prompts]
    together = 0
    while run.step():
        batches = run._runs.batches
        together = max(together, len(batches.get(policy, ())))
        assert set(batches) <= {policy}  # never a batch of its own
        assert run.kv_bytes_in_use() <= run._runs.projected()  # what admission counted: each batch at its widest
    assert [r.token_ids for r in requests] == solo and together == 3


@pytest.mark.parametrize("name", ["kvzip", "kvzipwhole"])
def test_a_question_sent_during_the_documents_pass_waits_for_it(name):
    """A document asked for one token answers from its held prompt, before its pass ends; a question sent then (the
    document plus its tokens) waits the pass's steps and starts from the kept document, not from a prefill beside it,
    answering as the library's compress and then the question."""
    run, policy = engine(session_memory=2**30), h2o_kv.policies.build(name, 12)
    document, question = ids(40, seed=9), ids(7, seed=10)
    first = run.submit(document, max_tokens=1, policy=policy)
    while not first.done:
        run.step()
    assert run._runs.passes  # answered; the pass goes on
    asked = run.submit(document + question, max_tokens=ANSWER, ignore_eos=True, policy=policy)
    run.run()
    assert asked.reused_tokens == 40
    cache, _ = compress_with_logits(run.model, torch.tensor([document]), policy, tokenizer=run.tokenizer, chunk=CHUNK)
    with torch.no_grad():
        logits = prefill(run.model, cache, torch.tensor([question]), chunk=CHUNK, start=40)
    assert asked.token_ids == greedy(run.model, cache, logits, 47, ANSWER)


def test_a_kept_prefix_is_extended_without_a_pass_as_the_library_feeds_a_question():
    run, policy = engine(session_memory=2**30), h2o_kv.KVzip(budget=12)
    first = ask(run, ids(40, seed=7), policy=policy)
    prompt = first.prompt_ids + first.token_ids + ids(9, seed=8)
    second = ask(run, prompt, policy=policy)
    assert second.reused_tokens == 40 + ANSWER - 1 and not run._runs.passes
    answer, cache = one_cache(run, first.prompt_ids, policy)  # compress, the answer, then the new tokens fed
    assert first.token_ids == answer
    seen = first.prompt_ids + answer[:-1]
    with torch.no_grad():
        logits = prefill(run.model, cache, torch.tensor([prompt[len(seen) :]]), chunk=CHUNK, start=len(seen))
    assert second.token_ids == greedy(run.model, cache, logits, len(prompt), ANSWER)


@pytest.mark.parametrize("where", ["held", "reconstruction"])
def test_an_error_in_the_pass_ends_only_that_request(where):
    run = engine()
    bad, good, other = ids(40, seed=1), ids(30, seed=2), ids(25, seed=3)
    solo = [ask(engine(), p, **kw).token_ids for p, kw in ((good, {}), (other, dict(policy="h2o", budget=8)))]
    failed = []
    prefill_call, score_call = run._steps._prefill_call, run._steps._score_call

    def held(cache, chunk, start):
        if where == "held" and start == CHUNK and chunk == bad[start : start + len(chunk)]:
            failed.append(cache)
            raise RuntimeError("boom")
        return prefill_call(cache, chunk, start)

    def scored(job):
        if where == "reconstruction" and job.length == len(bad) and job.scored == 1:
            failed.append(job.cache)
            raise RuntimeError("boom")
        return score_call(job)

    run._steps._prefill_call, run._steps._score_call = held, scored
    requests = [run.submit(p, max_tokens=ANSWER, ignore_eos=True, **kw)
                for p, kw in ((bad, {}), (good, {}), (other, dict(policy="h2o", budget=8)))]  # fmt: skip
    run.run()
    assert requests[0].finish_reason == "error" and "RuntimeError: boom" in requests[0].error
    assert [r.token_ids for r in requests[1:]] == solo
    (cache,) = failed
    assert cache.settings.reconstruction is None and cache.nbytes() == 0  # the pass left, emptied
    assert not run._runs.passes and not run._runs.prefill and run.kv_bytes_in_use() == 0


@pytest.mark.parametrize("steps", [1, 4], ids=["held", "reconstruction"])
def test_a_request_cancelled_in_its_pass_leaves_it(steps):
    run = engine()
    request = run.submit(ids(40, seed=4), max_tokens=ANSWER, ignore_eos=True)  # 3 held chunks, 3 calls
    for _ in range(steps):
        run.step()
    job = run._runs.passes[request]
    assert job.held == (steps > 3) and len(request.token_ids) == (steps > 3)
    request.cancel()
    run.step()
    assert request.finish_reason == "cancelled" and not job.open and job.cache.nbytes() == 0
    assert not run._runs.passes and run.kv_bytes_in_use() == 0 and run.stats()["finished_requests"] == 1
    assert ask(run, ids(12, seed=5)).finish_reason == "length"


def test_a_request_its_first_token_ends_finishes_its_pass_even_if_cancelled():
    run = engine(session_memory=2**30)
    prompt = ids(40, seed=6)
    request = run.submit(prompt, max_tokens=1, ignore_eos=True)
    for _ in range(3):  # the held chunks: the first token ends it
        run.step()
    assert request.finish_reason == "length" and request in run._runs.passes
    request.cancel()
    run.run()
    assert request.finish_reason == "length" and request.stats(1)["seen_tokens"] == 40
    assert run.stats()["prefix_entries"] == 1 and run.stats()["finished_requests"] == 1


def test_prefill_turn_counts_a_pass_by_its_calls_left():
    """A pass's prompt is in long before its reconstruction calls are done: it is neither through nor a short prompt
    until one call is left."""
    run = engine(chunk=8)
    long = run.submit(ids(100, seed=1), max_tokens=ANSWER, policy="h2o", budget=8)
    kvzip = run.submit(ids(20, seed=2), max_tokens=ANSWER)  # 3 held chunks, then 3 reconstruction calls
    runs = run._runs
    runs.admit()
    (oldest, item) = list(runs.prefill)
    assert [runs.calls_left(i, 8) for i in (oldest, item)] == [13, 6]
    for left in (5, 4, 3, 2, 1):
        assert runs.prefill_turn(8) == [oldest]
        with torch.no_grad():
            run._steps._prefill_chunk(runs, item)
        assert runs.calls_left(item, 8) == left and item in runs.prefill
    assert kvzip.token_ids and item[1].seen_tokens == 20  # its prompt is in: not through
    assert runs.prefill_turn(8) == [item, oldest]
    run.run()
    assert len(long.token_ids) == len(kvzip.token_ids) == ANSWER
    stub = types.SimpleNamespace(pieces_left=2)
    runs.passes[kvzip] = stub  # its prompt is in: what is left is its job's reconstruction calls
    assert runs.calls_left((kvzip, item[1]), 8) == 2


def test_kvzip_is_served_by_name_and_inspected():
    run = Engine(make_model("llama"), make_tokenizer(), policy="kvzip", budget=0.5)
    assert run.resolve_policy() == h2o_kv.KVzip(budget=0.5)
    assert run.generate(ids(20, seed=1), max_tokens=3, ignore_eos=True).completion_tokens == 3

    from h2o_kv.runtime.generation import encode
    from h2o_kv.studies.inspect.run import inspect, parse_policies

    asked = parse_policies(["kvzip@0.5"], None)
    text = "The quick brown fox jumps over the lazy dog. " * 2
    (seen,) = inspect(run.model, run.tokenizer, text, asked, model_name="tiny").runs
    prompt = torch.tensor([encode(run.tokenizer, text)])
    library = compress_with_logits(run.model, prompt, asked[0][1], tokenizer=run.tokenizer)[0]
    assert torch.equal(seen.kept.kept, library.kept_map(0).cpu().kept)

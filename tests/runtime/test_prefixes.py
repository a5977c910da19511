"""Automatic prefix reuse: a kept cache serves the prompts that extend it, exactly as one cache fed the same calls."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.engine import Engine
from h2o_kv.runtime.generation import decode_step, greedy_continue, prefill
from h2o_kv.runtime.prefixes import PrefixStore

from conftest import make_model, make_tokenizer, random_ids

CHUNK = 16
ANSWER = 6  # tokens per answer (ignore_eos: every answer ends by length)


def ids(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


def engine(session_memory: int | None = 2**30, **kwargs) -> Engine:
    return Engine(make_model("llama"), make_tokenizer(), prefill_chunk=CHUNK, session_memory=session_memory, **kwargs)


def first_logits(engine: Engine) -> list[torch.Tensor]:
    """Every prefill call's last logits, in order (a prompt's last call gives its first token's)."""
    calls, original = [], engine._steps._prefill_call

    def call(cache, ids, start):
        calls.append(original(cache, ids, start))
        return calls[-1]

    engine._steps._prefill_call = call
    return calls


def ask(engine: Engine, prompt: list[int], **kwargs):
    request = engine.submit(prompt, max_tokens=ANSWER, ignore_eos=True, **kwargs)
    engine.run()
    return request


def one_cache(model, policy, first: list[int], extensions: list[list[int]]) -> list[tuple[torch.Tensor, list[int]]]:
    """The library run: one KVCache fed the first prompt, its answer but the last token, the next turn's new tokens
    (in the engine's prefill chunks), its answer, ... Each turn's prompt is the last one, its answer and an extension.
    Returns each turn's (first token's logits, greedy answer)."""
    cache, prompt, seen, turns = h2o_kv.KVCache(policy, prompt_len=len(first)), first, [], []
    for extension in [None, *extensions]:
        if extension is not None:
            prompt = prompt + turns[-1][1] + extension
        with torch.no_grad():
            logits = prefill(model, cache, torch.tensor([prompt[len(seen) :]]), chunk=CHUNK, start=len(seen))
            head, answer = logits[0], [int(logits.argmax(-1))]
            while len(answer) < ANSWER:
                step = torch.tensor([len(prompt) + len(answer) - 1])
                answer.append(int(decode_step(model, cache, torch.tensor([answer[-1]]), step).argmax(-1)))
        seen = prompt + answer[:-1]
        turns.append((head, answer))
    return turns


def test_full_reuse_gives_a_fresh_prefills_logits():
    reusing, fresh = engine(), engine(None)
    logits, fresh_logits = first_logits(reusing), first_logits(fresh)
    first = ask(reusing, ids(40, seed=1), policy="full")
    prompt = first.prompt_ids + first.token_ids + ids(20, seed=2)
    second = ask(reusing, prompt, policy="full")
    assert second.reused_tokens == 40 + ANSWER - 1
    assert len(logits) == 3 + 2  # 40 tokens in 3 chunks; then only the 25 new ones, in 2
    baseline = ask(fresh, prompt, policy="full")
    torch.testing.assert_close(logits[-1], fresh_logits[-1], atol=1e-5, rtol=1e-4)
    assert second.token_ids == baseline.token_ids and baseline.reused_tokens == 0
    stats = reusing.stats()
    assert stats["prefix_hits"] == 1 and stats["prefix_tokens_reused"] == 45 and stats["prefix_entries"] == 2


@pytest.mark.parametrize("policy", [h2o_kv.H2O(budget=12), h2o_kv.H2O(budget=0.3), h2o_kv.SnapKV(budget=10)],
                         ids=["h2o-12", "h2o-0.3", "snapkv-10"])  # fmt: skip
def test_evicted_reuse_equals_one_cache_fed_the_same_calls(policy):
    run = engine()
    logits = first_logits(run)
    first, extensions = ids(40, seed=3), [ids(10, seed=4), ids(21, seed=5)]
    expected = one_cache(run.model, policy, first, extensions)
    prompt, answer, reused = first, [], []
    for turn, extension in enumerate([None, *extensions]):
        prompt = prompt + answer + (extension or [])
        request = ask(run, prompt, policy=policy)
        answer = request.token_ids
        assert request.token_ids == expected[turn][1]
        assert torch.equal(logits[-1][0], expected[turn][0])
        reused.append(request.reused_tokens)
    assert reused == [0, 40 + ANSWER - 1, 40 + ANSWER + 10 + ANSWER - 1]


def test_a_shared_prefix_serves_many_requests_at_once():
    """Three prompts extending one kept document decode together; each answers as its own one-cache run, and so does
    a third turn reusing the cache of a row that finished in that batch."""
    run, policy = engine(), h2o_kv.H2O(budget=12)
    document = ask(run, ids(40, seed=6), policy=policy)
    extensions = [ids(5 + 4 * i, seed=10 + i) for i in range(3)]
    requests = [
        run.submit(document.prompt_ids + document.token_ids + e, max_tokens=ANSWER, ignore_eos=True, policy=policy)
        for e in extensions
    ]
    run.run()
    expected = [one_cache(run.model, policy, document.prompt_ids, [e]) for e in extensions]
    assert [r.token_ids for r in requests] == [e[1][1] for e in expected]
    assert [r.reused_tokens for r in requests] == [40 + ANSWER - 1] * 3
    later = ids(7, seed=20)
    third = ask(run, requests[1].prompt_ids + requests[1].token_ids + later, policy=policy)
    assert third.reused_tokens == requests[1].prompt_tokens + ANSWER - 1
    assert third.token_ids == one_cache(run.model, policy, document.prompt_ids, [extensions[1], later])[2][1]
    assert run.stats()["prefix_hits"] == 4


def test_least_recently_used_go_first_and_the_budget_is_never_exceeded():
    policy = h2o_kv.H2O(budget=12)
    probe = engine()
    ask(probe, ids(30, seed=1), policy=policy)
    one = probe.stats()["prefix_bytes_held"]  # every kept cache here holds its 12 slots (+1): the same bytes
    run, fresh = engine(one * 5 // 2), engine(None)  # two kept caches fit, three do not

    def steps(prompt):
        request = run.submit(prompt, max_tokens=ANSWER, ignore_eos=True, policy=policy)
        while run.step():
            assert run.stats()["prefix_bytes_held"] <= one * 5 // 2
        return request

    a, b = steps(ids(30, seed=1)), steps(ids(30, seed=2))
    assert run.stats()["prefix_entries"] == 2
    a2 = steps(a.prompt_ids + a.token_ids + ids(5, seed=3))  # uses a, then keeps a2: b, the least recent, goes
    a3 = steps(a.prompt_ids + a.token_ids + ids(9, seed=5))  # a is still there
    assert a2.reused_tokens == a3.reused_tokens == 30 + ANSWER - 1
    dropped = b.prompt_ids + b.token_ids + ids(5, seed=4)
    b2 = steps(dropped)
    assert b2.reused_tokens == 0
    assert b2.token_ids == ask(fresh, dropped, policy=policy).token_ids  # a dropped prefix answers as a fresh run
    stats = run.stats()
    assert stats["prefix_dropped"] >= 2 and 0 < stats["prefix_bytes_peak"] <= one * 5 // 2


def test_a_prefix_a_waiting_request_wants_is_not_dropped_to_keep_another():
    """A conversation's next turn queued behind other work keeps its prefix: keeping a finished request's cache drops
    the least recently used kept cache that no waiting request would start from; when every other is wanted, the new
    cache is not kept. The store never holds more than its budget."""
    policy = h2o_kv.H2O(budget=12)
    probe = engine()
    ask(probe, ids(30, seed=1), policy=policy)
    one = probe.stats()["prefix_bytes_held"]
    for room, expected in ((one * 5 // 2, 2), (one * 3 // 2, 1)):  # two kept caches fit / one fits
        run = engine(room, max_batch=1)
        a = ask(run, ids(30, seed=1), policy=policy)
        if expected == 2:
            ask(run, ids(30, seed=2), policy=policy)  # kept after a: a is the least recently used
        c = run.submit(ids(30, seed=6), max_tokens=ANSWER, ignore_eos=True, policy=policy)
        a2 = run.submit(a.prompt_ids + a.token_ids + ids(5, seed=3), max_tokens=ANSWER, ignore_eos=True, policy=policy)
        while run.step():
            assert run.stats()["prefix_bytes_held"] <= room
        assert c.result().completion_tokens == ANSWER and a2.reused_tokens == 30 + ANSWER - 1, room
        assert run.stats()["prefix_entries"] == expected  # a2 kept; beside it b dropped for c (two fit), or c not kept


def test_kept_caches_make_room_for_running_requests_within_kv_memory():
    policy, big = h2o_kv.Full(), ids(120, seed=7)
    limit = 2 * engine().kv_bytes_for(len(big), ANSWER, policy)  # the big prompt going in plus its batch row
    run = engine(kv_memory=limit)
    small = ask(run, ids(60, seed=8), policy=policy)
    assert run.stats()["prefix_entries"] == 1
    request = run.submit(big, max_tokens=ANSWER, ignore_eos=True, policy=policy)
    run.step()  # admitted at once: the kept cache is dropped for it, not the request kept waiting
    stats = run.stats()
    assert stats["waiting"] == 0 and stats["running"] == 1
    assert stats["prefix_entries"] == 0 and stats["prefix_dropped"] == 1
    assert stats["prefix_bytes_held"] + run._runs.projected() <= limit
    run.run()
    assert request.result().completion_tokens == ANSWER and small.reused_tokens == 0


def test_without_session_memory_nothing_is_kept():
    for run in (engine(None), engine(0)):
        assert run.prefixes is None and run.session_memory is None
        first = ask(run, ids(30, seed=1), policy="h2o", budget=12)
        second = ask(run, first.prompt_ids + first.token_ids + ids(5, seed=2), policy="h2o", budget=12)
        stats = run.stats()
        assert second.reused_tokens == 0 and stats["prefix_hits"] == stats["prefix_bytes_held"] == 0
        assert run.kv_bytes_in_use() == 0
    with pytest.raises(ValueError, match="session_memory"):
        engine(-1)


def test_reuse_needs_the_same_policy_and_a_proper_prefix():
    run = engine()
    first = ask(run, ids(30, seed=1), policy="h2o", budget=12)
    seen = first.prompt_ids + first.token_ids[:-1]
    assert ask(run, seen + [5], policy="h2o", budget=16).reused_tokens == 0  # another policy: its own cache
    assert ask(run, seen, policy="h2o", budget=12).reused_tokens == 0  # nothing new to prefill
    assert ask(run, seen + [5], policy="h2o", budget=12).reused_tokens == len(seen)


def test_a_store_keeps_nothing_larger_than_its_budget():
    run = engine(100)
    ask(run, ids(30, seed=1), policy="full")
    assert run.stats()["prefix_entries"] == 0 and run.stats()["prefix_bytes_held"] == 0
    small = engine()
    ask(small, ids(30, seed=1), policy="h2o", budget=12)
    run = engine(small.stats()["prefix_bytes_held"] * 3 // 2)
    ask(run, ids(30, seed=1), policy="h2o", budget=12)
    ask(run, ids(60, seed=2), policy="full")  # larger than the whole budget: not kept, and nothing dropped for it
    assert run.stats()["prefix_entries"] == 1 and run.stats()["prefix_dropped"] == 0
    with pytest.raises(ValueError, match="budget"):
        PrefixStore(0)


def test_the_server_reuses_a_conversation_and_counts_it():
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from serve_helpers import MODEL, client, metric, running_server

    text = "Once upon a time, in a land far away, there lived a"
    with running_server(make_model("llama"), make_tokenizer(), policy="full", prefill_chunk=CHUNK,
                        session_memory=2**24) as (engine, url):  # fmt: skip
        api = client(url)
        first = api.completions.create(model=MODEL, prompt=text, max_tokens=ANSWER, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(url, "h2o_kv_prefix_entries") == 1 and metric(url, "h2o_kv_prefix_hits_total") == 0
        held = metric(url, "h2o_kv_prefix_bytes_held")
        assert 0 < held <= 2**24
        # the next turn resends the conversation: the kept cache had seen all of it but the answer's last token
        second = api.completions.create(
            model=MODEL,
            prompt=text + first.choices[0].text + " who",
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        use = [chunk.usage for chunk in second if chunk.usage is not None][0]  # OpenAI's field for reused tokens
        reused = len(text) + first.usage.completion_tokens - 1
        assert use.prompt_tokens_details.cached_tokens == reused
        assert metric(url, "h2o_kv_prefix_hits_total") == 1
        assert metric(url, "h2o_kv_prefix_tokens_reused_total") == reused
        assert metric(url, "h2o_kv_prefix_bytes_held") > held and engine.stats()["prefix_entries"] == 2


def one_cache_after_prompt(model, policy, prompt: list[int], rest: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The library run of a turn that resends the prompt but not the answer's tokens: one KVCache fed the prompt, then
    `rest` (in the engine's prefill chunks); its first token's logits and greedy answer."""
    cache = h2o_kv.KVCache(policy, prompt_len=len(prompt))
    with torch.no_grad():
        prefill(model, cache, torch.tensor([prompt]), chunk=CHUNK)
        logits = prefill(model, cache, torch.tensor([rest]), chunk=CHUNK, start=len(prompt))
        return logits[0], greedy_continue(model, cache, logits, len(prompt) + len(rest), ANSWER)


@pytest.mark.parametrize("policy", [h2o_kv.H2O(budget=12), h2o_kv.SnapKV(budget=0.3)], ids=["h2o-12", "snapkv-0.3"])
def test_a_next_turn_that_rewrites_the_answer_starts_from_the_prompts_cache(policy):
    """A client that sends the answer back otherwise (its text tokenizes differently, or a chat template drops the
    reasoning): with `resend` saying so, the store keeps the prompt's cache as it was when the prompt was through, not
    the answer's, and the next turn prefills only the rewritten answer and its new tokens, answering as one cache fed
    the prompt and then those tokens."""
    run = engine()
    logits = first_logits(run)
    prompt, rewritten, new = ids(40, seed=30), ids(4, seed=31), ids(9, seed=32)
    resend = lambda text: prompt + rewritten  # noqa: E731
    first = run.submit(prompt, max_tokens=ANSWER, ignore_eos=True, policy=policy, resend=resend)
    run.run()
    assert first.result().completion_tokens == ANSWER
    assert run.stats()["prefix_entries"] == 1  # the prompt's cache; the answer's, which no next turn extends, is not
    as_generated = ask(run, first.prompt_ids + first.token_ids + new, policy=policy)
    assert as_generated.reused_tokens == 40  # only the prompt's cache was kept
    second = ask(run, prompt + rewritten + new, policy=policy)
    assert second.reused_tokens == 40
    head, answer = one_cache_after_prompt(run.model, policy, prompt, rewritten + new)
    assert second.token_ids == answer and torch.equal(logits[-1][0], head)


def test_resend_keeps_the_cache_the_next_turn_extends_and_only_that():
    policy, prompt, new = h2o_kv.H2O(budget=12), ids(30, seed=40), ids(5, seed=41)
    whole = engine()  # the answer resent as generated: the prompt and answer's cache, the prompt's copy let go
    first = whole.submit(prompt, max_tokens=ANSWER, ignore_eos=True, policy=policy,
                         resend=lambda text: first.prompt_ids + first.token_ids)  # fmt: skip
    whole.run()
    assert whole.stats()["prefix_entries"] == 1
    assert ask(whole, first.prompt_ids + first.token_ids + new, policy=policy).reused_tokens == 30 + ANSWER - 1
    other = engine()  # a next turn that does not extend the answer: the prompt's copy, for whatever extends it
    other.submit(prompt, max_tokens=ANSWER, ignore_eos=True, policy=policy, resend=lambda text: new)
    other.run()
    assert other.stats()["prefix_entries"] == 1
    assert ask(other, prompt + new, policy=policy).reused_tokens == 30  # a question after the document, say
    one = engine()  # a one-token answer: its cache has seen only the prompt, and is kept whatever the next turn
    one.submit(prompt, max_tokens=1, policy=policy, resend=lambda text: new)
    one.run()
    assert ask(one, prompt + new, policy=policy).reused_tokens == 30
    broken = engine()  # a resend that fails: logged, and the whole cache kept as without one

    def fails(text):
        raise RuntimeError("no template")

    first = broken.submit(prompt, max_tokens=ANSWER, ignore_eos=True, policy=policy, resend=fails)
    broken.run()
    assert first.result().completion_tokens == ANSWER and broken.stats()["prefix_entries"] == 1
    assert ask(broken, first.prompt_ids + first.token_ids + new, policy=policy).reused_tokens == 30 + ANSWER - 1
    stopped = engine()  # an answer stopped by the client: its prompt's cache stays for the conversation going on
    request = stopped.submit(prompt, max_tokens=50, ignore_eos=True, policy=policy, resend=lambda text: prompt + new)
    while len(request.token_ids) < 3:
        stopped.step()
    request.cancel()
    stopped.run()
    assert request.result().finish_reason == "cancelled" and stopped.stats()["prefix_entries"] == 1
    assert ask(stopped, prompt + request.token_ids[:2] + new, policy=policy).reused_tokens == 30


def test_the_server_reuses_a_chat_whose_template_rewrites_earlier_answers():
    """A chat template that drops earlier answers' text from the history, as reasoning models' templates drop the
    reasoning: the answer's own cache can never be extended, so the server keeps the prompt's, and the next turn
    reuses it (without `resend` it would prefill the whole conversation)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from serve_helpers import MODEL, client, running_server

    tokenizer = make_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if m['role'] == 'assistant' %}(answered){% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    question = [{"role": "user", "content": "Once upon a time, in a land far away"}]
    with running_server(make_model("llama"), tokenizer, policy="full", prefill_chunk=CHUNK,
                        session_memory=2**24) as (engine, url):  # fmt: skip
        api = client(url)
        first = api.chat.completions.create(model=MODEL, messages=question, max_tokens=ANSWER, temperature=0)
        asked = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        history = [*question, {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "and then?"}]  # fmt: skip
        second = api.chat.completions.create(model=MODEL, messages=history, max_tokens=ANSWER, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens == len(asked)  # the first prompt's cache
        assert engine.stats()["prefix_hits"] == 1
    with running_server(make_model("llama"), tokenizer, policy="full", prefill_chunk=CHUNK) as (_, url):
        fresh = client(url).chat.completions.create(model=MODEL, messages=history, max_tokens=ANSWER, temperature=0)
    assert second.choices[0].message.content == fresh.choices[0].message.content


def test_the_serve_flag_is_a_size_and_off_by_default():
    from h2o_kv.cli import build_parser
    from h2o_kv.runtime.serve.main import engine_settings

    parse = build_parser().parse_args
    assert engine_settings(parse(["serve", "--session-memory", "256MiB"]))["session_memory"] == 256 * 2**20
    assert engine_settings(parse(["serve"]))["session_memory"] is None
    assert engine_settings(parse(["serve", "--session-memory", "0"]))["session_memory"] is None
    with pytest.raises(ValueError, match="--session-memory 'lots' is not a size"):
        engine_settings(parse(["serve", "--session-memory", "lots"]))

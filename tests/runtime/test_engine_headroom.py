"""The engine's `headroom`: after its prompt, each row holds that many tokens past its budget, so questions after a
kept document join it without evicting any of it, as one `KVCache(headroom=)` fed the same calls does."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.engine import Engine
from h2o_kv.runtime.generation import greedy_continue, prefill

from conftest import make_model, make_tokenizer, random_ids

CHUNK, ANSWER, HEADROOM = 16, 6, 20


def ids(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


def library(model, policy, document: list[int], question: list[int], headroom: int) -> tuple[torch.Tensor, list]:
    """One KVCache(headroom=) fed the document (in the engine's chunks), its prompt then complete, then the question:
    the first token's logits and the greedy answer."""
    cache = h2o_kv.KVCache(policy, prompt_len=len(document), headroom=headroom)
    with torch.no_grad():
        prefill(model, cache, torch.tensor([document]), chunk=CHUNK)
        cache.end_prompt()
        logits = prefill(model, cache, torch.tensor([question]), chunk=CHUNK, start=len(document))
        return logits[0], greedy_continue(model, cache, logits, len(document) + len(question), ANSWER)


@pytest.mark.parametrize("in_place", [False, True], ids=["packed", "in-place"])
@pytest.mark.parametrize("policy", [h2o_kv.H2O(budget=12), h2o_kv.AdaKV(h2o_kv.SnapKV(budget=10))],
                         ids=["h2o", "adakv"])  # fmt: skip
def test_questions_after_a_kept_document_join_it_without_evicting_it(policy, in_place) -> None:
    run = Engine(make_model("llama"), make_tokenizer(), prefill_chunk=CHUNK, session_memory=2**30,
                 headroom=HEADROOM, rows_in_place=in_place)  # fmt: skip
    calls, original = [], run._steps._prefill_call
    run._steps._prefill_call = lambda cache, ids, start: calls.append(original(cache, ids, start)) or calls[-1]
    document = ids(40, seed=1)
    run.submit(document, max_tokens=1, policy=policy)  # compressed alone, kept for the questions
    run.run()
    questions = [ids(6, seed=2), ids(9, seed=3)]
    asked = [run.submit(document + q, max_tokens=ANSWER, ignore_eos=True, policy=policy) for q in questions]
    run.run()  # both questions prefill their few tokens from forks of the document, then decode in one batch
    for request, question in zip(asked, questions, strict=True):
        head, answer = library(run.model, policy, document, question, HEADROOM)
        assert request.reused_tokens == 40 and request.token_ids == answer
        assert any(torch.equal(call[0], head) for call in calls)
        # every token after the document was appended: the document's kept tokens are all there
        budget = 12 if isinstance(policy, h2o_kv.H2O) else 10
        assert request.stats()["kept_tokens"] >= budget + len(question) + ANSWER - 1


def test_without_headroom_the_question_evicts_and_admission_counts_it() -> None:
    model, tokenizer, policy = make_model("llama"), make_tokenizer(), h2o_kv.H2O(budget=12)
    run = Engine(model, tokenizer, prefill_chunk=CHUNK, session_memory=2**30)
    document, question = ids(40, seed=1), ids(6, seed=2)
    run.submit(document, max_tokens=1, policy=policy)
    run.run()
    request = run.submit(document + question, max_tokens=ANSWER, ignore_eos=True, policy=policy)
    run.run()
    assert request.reused_tokens == 40 and request.stats()["kept_tokens"] == 12
    assert request.token_ids == library(model, policy, document, question, 0)[1]
    roomy = Engine(model, tokenizer, prefill_chunk=CHUNK, headroom=HEADROOM)
    plain = Engine(model, tokenizer, prefill_chunk=CHUNK)
    assert roomy.kv_bytes_for(200, 50, policy) == plain.kv_bytes_for(200, 50, h2o_kv.H2O(budget=12 + HEADROOM))
    assert roomy.kv_bytes_for(200, 50, h2o_kv.Full()) == plain.kv_bytes_for(200, 50, h2o_kv.Full())
    with pytest.raises(ValueError, match="headroom"):
        Engine(model, tokenizer, headroom=-1)


def test_the_serve_flag() -> None:
    from h2o_kv.cli import build_parser
    from h2o_kv.runtime.serve.main import engine_settings

    parse = build_parser().parse_args
    assert engine_settings(parse(["serve", "--headroom", "64"]))["headroom"] == 64
    assert engine_settings(parse(["serve"]))["headroom"] == 0
    with pytest.raises(ValueError, match="--headroom"):
        engine_settings(parse(["serve", "--headroom", "-1"]))


def test_compress_a_document_once_and_ask_many_through_the_api() -> None:
    """The server's "compress once, answer many": the document alone (one token asked) is compressed by KVzip's own
    allocation and kept; each question then starts from a fork of it, and its tokens and answer join it within the
    headroom. Each answer equals the library's: `compress` on the document, `end_prompt`, a fork fed the question."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from h2o_kv.runtime.compress import compress_with_logits

    from serve_helpers import MODEL, client, running_server

    model, tokenizer = make_model("llama"), make_tokenizer()
    policy, document = h2o_kv.policies.build("kvzipwhole", 0.5), ids(40, seed=5)
    questions = [ids(6, seed=6), ids(8, seed=7)]
    with running_server(model, tokenizer, policy="kvzipwhole", budget=0.5, prefill_chunk=CHUNK, headroom=HEADROOM,
                        session_memory=2**26) as (_, url):  # fmt: skip
        api = client(url)
        api.completions.create(model=MODEL, prompt=document, max_tokens=1, temperature=0)  # before its pass ends
        replies = [api.completions.create(model=MODEL, prompt=document + q, max_tokens=ANSWER, temperature=0,
                                          extra_body={"ignore_eos": True}) for q in questions]  # fmt: skip
    compressed = h2o_kv.KVCache(policy, prompt_len=len(document), headroom=HEADROOM)
    compress_with_logits(model, torch.tensor([document]), policy, tokenizer=tokenizer, chunk=CHUNK, cache=compressed)
    compressed.end_prompt()
    for reply, question in zip(replies, questions, strict=True):
        assert reply.usage.prompt_tokens_details.cached_tokens == len(document)
        cache = compressed.fork()
        with torch.no_grad():
            logits = prefill(model, cache, torch.tensor([question]), chunk=CHUNK, start=len(document))
            answer = greedy_continue(model, cache, logits, len(document) + len(question), ANSWER)
        assert reply.choices[0].text == tokenizer.decode(answer, skip_special_tokens=True)
        assert cache.kept_per_head().sum() == compressed.kept_per_head().sum() + cache.kept_per_head().numel() * (
            len(question) + ANSWER - 1
        )  # every token after the document appended: none of it evicted

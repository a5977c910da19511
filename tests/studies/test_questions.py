"""Compress once, answer many (issue 50): RULER samples with several questions over one context, each answered from a
fork of the context's one compressed cache, stored per question in resumable cells, and exported for kvpress."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from h2o_kv.policies import budget_tokens
from h2o_kv.runtime.generation import forward, greedy_continue
from h2o_kv.studies.eval.cells import Cells
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.retrieval import make_samples, run_shared
from h2o_kv.studies.eval.ruler import asked, score
from h2o_kv.studies.eval.ruler_fit import split_ids
from h2o_kv.studies.eval.ruler_spec import RULER_TASKS, SEVERAL_QUESTIONS, SPECS
from h2o_kv.studies.eval.ruler_tasks import make_ruler_sample
from h2o_kv.studies.eval.shared import shared_answers
from h2o_kv.studies.eval.sizes import SIZES

from conftest import make_model, make_tokenizer, random_ids
from ruler_helpers import HAYSTACK, WORDS
from serve_helpers import tiny_model

LENGTHS = {"qa_1": 2048, "qa_2": 2048}  # four gold documents (qa_2: pairs) need more room than a needle


def build(tokenizer, task: str, questions: int, seed: int = 3, length: int | None = None):
    length = length or LENGTHS.get(task, 1024)
    return make_ruler_sample(task, tokenizer=tokenizer, context_tokens=length, haystack=HAYSTACK, seed=seed,
                             words=WORDS, questions=questions)  # fmt: skip


@pytest.mark.parametrize("task", [*SEVERAL_QUESTIONS, "niah_multivalue"])
def test_each_question_has_its_golds_in_the_context_and_fits(tokenizer, task: str) -> None:
    s = build(tokenizer, task, 4)
    asks = asked(s)
    assert len(asks) == (1 if task == "niah_multivalue" else 4)  # one key: one question, asked once
    assert len({a.question for a in asks}) == len(asks) and len({tuple(a.answers) for a in asks}) == len(asks)
    context_ids, _ = split_ids(tokenizer, s)
    length = LENGTHS.get(task, 1024)
    for a in asks:
        c, q = split_ids(tokenizer, a)
        assert c == context_ids and a.context == s.context and a.prompt == s.context + a.question
        assert len(c) + len(q) + SPECS[task].tokens <= length  # RULER: prompt and answer within the length
        for gold in a.answers:
            assert gold.lower() in s.context.lower() and gold.lower() not in a.question.lower()
        assert score(a, " " + " ".join(a.answers)) == 1.0 and score(a, " none") == 0.0
    longest = max(len(split_ids(tokenizer, a)[1]) for a in asks)
    assert s.metadata["prompt_tokens"] == len(context_ids) + longest >= 0.9 * (length - SPECS[task].tokens)
    assert (asks[0].question, asks[0].answers) == (s.question, s.answers)


def test_one_question_is_todays_sample(tokenizer) -> None:
    """`questions=1` (and any count for a task that asks one) builds the one-question sample, field for field; the
    first of multikey_1's four questions asks the one-question sample's key, among the same needles."""
    for task in RULER_TASKS:
        if task == "cwe":  # too long for 1024 tokens at RULER's counts; its builder takes no questions
            continue
        one = build(tokenizer, task, 1)
        default = make_ruler_sample(task, tokenizer=tokenizer, context_tokens=LENGTHS.get(task, 1024),
                                    haystack=HAYSTACK, seed=3, words=WORDS)  # fmt: skip
        assert one == default and one.questions == [] and asked(one) == [one]
        if task not in SEVERAL_QUESTIONS:
            assert build(tokenizer, task, 4) == one
    four, one = build(tokenizer, "niah_multikey_1", 4), build(tokenizer, "niah_multikey_1", 1)
    assert four.metadata["keys"] == one.metadata["keys"] and four.answers == one.answers
    assert four.metadata["questions_asked"][0] == one.metadata["asked"][0]
    older = make_samples(tokenizer, HAYSTACK, tasks=["passkey"], context_tokens=400, n=2, seed=1, questions=4)
    assert older == make_samples(tokenizer, HAYSTACK, tasks=["passkey"], context_tokens=400, n=2, seed=1)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.mark.parametrize(("policy", "budget"), [("h2o", 12), ("snapkv", 10), ("kvzip", 12), ("h2o-int8", 12)])
def test_each_fork_answers_as_a_fresh_compression(llama, policy: str, budget: int) -> None:
    """Four questions from forks of one compressed cache answer, question by question, as a fresh cache of the policy
    that compresses the context itself and then reads that one question; the bytes are those after the context."""
    tokenizer = make_tokenizer()  # KVzip's pass asks the model to repeat the context through its chat template
    context = random_ids(1, 40, seed=7)[0].tolist()
    questions = [random_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 5, 4, 6)]
    make = lambda: new_cache(policy, budget, len(context))  # noqa: E731
    (outs, kv_bytes), = shared_answers(llama, context, {"one": make}, questions, max_new_tokens=6,
                                       tokenizer=tokenizer).values()  # fmt: skip
    for question, out in zip(questions, outs, strict=True):
        cache = make()
        with torch.no_grad():
            if policy == "kvzip":
                from h2o_kv.runtime.compress import compress

                compress(llama, torch.tensor([context]), cache=cache, tokenizer=tokenizer)
            else:
                forward(llama, cache, torch.tensor([context]))
            assert cache.kept_nbytes() == kv_bytes and cache.kept_tokens < len(context)
            positions = torch.arange(len(context), len(context) + len(question)).unsqueeze(0)
            logits = forward(llama, cache, torch.tensor([question]), positions=positions)
            alone = greedy_continue(llama, cache, logits, len(context) + len(question), 6)
        assert out == alone, (policy, question)
    assert len({tuple(o) for o in outs}) > 1  # the questions lead to different answers


def test_answers_decoded_in_groups_of_rows_are_the_same(llama, monkeypatch) -> None:
    """`max_rows` bounds the caches held while answers are decoded together: groups of caches, each decoded then let
    go, give every answer and byte count of one group of all."""
    import h2o_kv.studies.eval.shared as shared

    context = random_ids(1, 40, seed=7)[0].tolist()
    questions = [random_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 5, 4)]
    makers = {(p, b): (lambda p=p, b=b: new_cache(p, b, 40)) for p, b in
              [("full", None), ("h2o", 12), ("snapkv", 10), ("tova", 9), ("adakv", 10)]}  # fmt: skip
    calls = []
    together = shared.greedy_together
    monkeypatch.setattr(shared, "greedy_together", lambda model, caches, *a: calls.append(len(caches)) or
                        together(model, caches, *a))  # fmt: skip
    whole = shared_answers(llama, context, makers, questions, max_new_tokens=6)
    grouped = shared_answers(llama, context, makers, questions, max_new_tokens=6, max_rows=7)
    assert calls == [15, 6, 6, 3]  # two caches' three questions fit in 7 rows
    assert list(grouped) == list(makers) and grouped == whole


def test_cells_store_each_question_and_resume(tokenizer, tmp_path) -> None:
    """One cell per (sample, policy, budget) holds every question's answer; a rerun reuses them all and computes
    nothing. Query-aware reads each question inside its own prompt (a cell each); one-question cells keep their name."""
    torch.set_num_threads(1)
    model = tiny_model(tokenizer, context=2048)
    model.generation_config.eos_token_id = None
    samples = [build(tokenizer, "niah_multikey_2", 4, seed=4, length=520),
               build(tokenizer, "niah_multivalue", 4, seed=4, length=520)]  # fmt: skip
    configs = [("full", None), ("h2o", 0.25)]
    runs = {}
    for agnostic in (True, False):
        cells = Cells(tmp_path / "cells", {"model": "tiny"}, resume=True)
        runs[agnostic] = run_shared(model, tokenizer, samples, configs, cells=cells, gen_cap=3, agnostic=agnostic)
        assert cells.ran == len(configs) * (2 if agnostic else 5) and cells.reused == 0
        rows = {(r["policy"], r["subtask"]): r for r in runs[agnostic]}
        assert rows[("h2o", "niah_multikey_2")]["n"] == 4 and rows[("h2o", "niah_multivalue")]["n"] == 1
        assert rows[("h2o", "niah_multikey_2")]["kv_bytes"] < rows[("full", "niah_multikey_2")]["kv_bytes"]
    again = Cells(tmp_path / "cells", {"model": "tiny"}, resume=True)
    assert run_shared(model, tokenizer, samples, configs, cells=again, gen_cap=3, agnostic=True) == runs[True]
    assert again.ran == 0 and again.reused == len(configs) * 2
    keys = [json.loads(json.loads(p.read_text())["key"]) for p in (tmp_path / "cells").glob("*.json")]
    several = [k for k in keys if k["subtask"] == "niah_multikey_2" and k["setting"] == "agnostic"]
    assert {k["kind"] for k in several} == {"retrieval-questions"} and {k["questions"] for k in several} == {4}
    single = [k for k in keys if k["subtask"] == "niah_multivalue"]
    assert {k["kind"] for k in single} == {"retrieval-sample"} and not any("questions" in k for k in single)
    stored = json.loads(next(p for p in (tmp_path / "cells").glob("*.json")
                             if json.loads(json.loads(p.read_text())["key"]) == several[0]).read_text())  # fmt: skip
    assert [r["question"] for r in stored["rows"]] == [0, 1, 2, 3]


def test_the_preset_brings_its_tasks_policies_and_budgets_and_flags_win(monkeypatch, tmp_path, capsys) -> None:
    ret = SIZES["compress-once"].retrieval
    assert ret.questions == 4 and ret.prefills == ("agnostic",) and ret.contexts == (4096,) and ret.answer_cap is None
    assert set(ret.tasks) == {*SEVERAL_QUESTIONS, "niah_multivalue"} and SIZES["ruler4k"].retrieval.questions == 1
    from h2o_kv import cli
    from h2o_kv.runtime import models
    from h2o_kv.studies.eval import run

    seen = {}
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(run, "run_eval", lambda model, tokenizer, **kw: seen.update(kw) or [])
    assert cli.main(["eval", "--size", "compress-once", "--out", str(tmp_path)]) == 0
    assert seen["tasks"] == ["retrieval"] and seen["budgets"] == [0.25, 0.1] and seen["size"].retrieval == ret
    assert seen["policies"] == [
        "kvzipwindow",
        "kvziplayerwindow",
        "kvzipwhole",
        "kvzip",
        "keydiff",
        "snapkv",
        "globalkv",
        "tova",
        "h2o",
    ]
    argv = ["eval", "--size", "compress-once", "--policies", "h2o", "--budgets", "0.5", "--questions", "2", "--tasks",
            "retrieval,fidelity", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    assert (seen["policies"], seen["budgets"], seen["tasks"]) == (["h2o"], [0.5], ["retrieval", "fidelity"])
    assert seen["size"].retrieval.questions == 2
    assert cli.main(["eval", "--size", "small", "--out", str(tmp_path)]) == 0  # a size without its own: the defaults
    assert seen["policies"] == ["h2o", "local", "streamingllm", "tova"] and seen["budgets"] == [0.05, 0.1, 0.2, 0.5]
    assert cli.main(["eval", "--size", "compress-once", "--questions", "0"]) == 2
    assert "--questions must be at least 1" in capsys.readouterr().err


def _export():
    path = Path(__file__).resolve().parents[2] / "compare" / "kvpress" / "export_samples.py"
    spec = importlib.util.spec_from_file_location("export_samples", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kvpress_export_holds_every_question_with_the_same_ids(tokenizer, tmp_path) -> None:
    """compare/kvpress gets the context's ids and each question's, as h2o-kv feeds them; its cached predictions are
    re-scored per question by h2o-kv's scorer (export_samples.py --check)."""
    export = _export()
    s = build(tokenizer, "qa_1", 4)
    rec = export.sample_record(tokenizer, s, "qa_1-2048-00", [0.25, 0.1], None)
    asks = asked(s)
    assert rec["context_ids"] == split_ids(tokenizer, s)[0] and rec["input_ids"] == sum(split_ids(tokenizer, s), [])
    assert [q["question_ids"] for q in rec["questions"]] == [split_ids(tokenizer, a)[1] for a in asks]
    assert [q["answers"] for q in rec["questions"]] == [a.answers for a in asks] and rec["max_new_tokens"] == 32
    assert rec["h2o_kv_budget_tokens_agnostic"]["0.25"] == budget_tokens(0.25, len(rec["context_ids"]))
    one = export.sample_record(tokenizer, build(tokenizer, "qa_1", 1), "qa_1-2048-00", [0.25], None)
    assert "questions" not in one and one["question_ids"] == split_ids(tokenizer, build(tokenizer, "qa_1", 1))[1]
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps(rec) + "\n")
    predictions = [f" {a.answers[0]}" if i % 2 else " no idea" for i, a in enumerate(asks)]
    result = {"predictions": predictions, "scores": [0.0, 1.0, 0.0, 1.0], "score": 0.5}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"cells": {"c": {"press": "snapkv", "ratio": 0.75, "samples": {rec["id"]: result}}}}))
    export.check(str(results), str(samples))  # exits 1 on a mismatch
    result["scores"] = [1.0, 1.0, 0.0, 1.0]
    results.write_text(json.dumps({"cells": {"c": {"press": "snapkv", "ratio": 0.75, "samples": {rec["id"]: result}}}}))
    with pytest.raises(SystemExit):
        export.check(str(results), str(samples))

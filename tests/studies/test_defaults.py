"""The defaults' measurement (h2o_kv/studies/defaults.py): its questions, its scoring, and a run that resumes."""

from __future__ import annotations

import json

from h2o_kv.runtime import models
from h2o_kv.studies import defaults


def test_every_question_is_answered_by_the_passage_and_a_shorter_passage_asks_fewer() -> None:
    text = defaults.passage()
    assert len(text.split()) == defaults.DEFAULT_WORDS and text.startswith(defaults.PASSAGE_START)
    assert defaults.questions(text) == list(defaults.QUESTIONS)
    short = defaults.questions(defaults.passage(400))
    assert 0 < len(short) < len(defaults.QUESTIONS)
    assert all(any(a in defaults.passage(400).lower() for a in accepted) for _, accepted in short)


def test_an_answer_is_right_when_it_names_an_accepted_string() -> None:
    assert defaults.correct("North-north-west, he says.", ("north-north-west",))
    assert defaults.correct("north north west", ("north-north-west",))
    assert defaults.correct("SENECA and Plautus", ("seneca", "plautus"))
    assert not defaults.correct("Polonius", ("jephthah",))


def test_a_run_writes_one_line_per_question_resumes_and_tabulates(tmp_path, monkeypatch, tokenizer) -> None:
    """A tiny random model: every cache answers each question, the bounded ones keep a fraction of Full's bytes,
    and a second run finds nothing left to do."""
    from serve_helpers import tiny_model

    model = tiny_model(tokenizer)
    loads = []
    monkeypatch.setattr(models, "load_model", lambda name, **kw: loads.append(name) or (model, tokenizer))
    out = tmp_path / "runs.jsonl"
    run = dict(words=400, compared=["globalkv@0.2", "h2o@0.2"], max_new_tokens=3, threads=None)
    defaults.run(["smollm2-135m"], out, **run)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question"] for r in rows] == [q for q, _ in defaults.questions(defaults.passage(400))]
    for row in rows:
        cells = row["cells"]
        assert list(cells) == ["full", "globalkv@0.2", "h2o@0.2"]
        full = cells["full"]["kept_bytes"]
        assert all(0 < cells[k]["kept_bytes"] <= 0.21 * full for k in ("globalkv@0.2", "h2o@0.2"))
    defaults.run(["smollm2-135m"], out, **run)
    assert loads == ["smollm2-135m"] and len(out.read_text().splitlines()) == len(rows)
    table = defaults.table(rows)
    assert "| full |" in table and "| globalkv@0.2 |" in table and "400 words of Hamlet" in table

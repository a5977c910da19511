"""RULER's thirteen tasks (issue 52): built at a small length with the bundled tokenizer, split into context and
question the way both settings and kvpress read them, scored by RULER's rules; and the two settings run end to end."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from h2o_kv.runtime.generation import greedy_continue, prefill
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.retrieval import answer_tokens, make_samples, run_shared
from h2o_kv.studies.eval.ruler import RULER_TASKS, Sample, score, string_match_all, string_match_part
from h2o_kv.studies.eval.ruler_fit import split_ids
from h2o_kv.studies.eval.ruler_spec import SPECS, SUBSTITUTES, label
from h2o_kv.studies.eval.ruler_tasks import make_ruler_dataset, make_ruler_sample
from h2o_kv.studies.eval.ruler_words import _zeta
from h2o_kv.studies.eval.sizes import SIZES, check_retrieval

from ruler_helpers import HAYSTACK, WORDS
from serve_helpers import tiny_model

LENGTH = 1024


def build(tokenizer, task: str, seed: int = 3, length: int = LENGTH) -> Sample:
    return make_ruler_sample(task, tokenizer=tokenizer, context_tokens=length, haystack=HAYSTACK, seed=seed,
                             words=WORDS)  # fmt: skip


@pytest.fixture(scope="module")
def samples(tokenizer) -> dict[str, Sample]:
    return {task: build(tokenizer, task) for task in RULER_TASKS}


def test_thirteen_tasks_with_rulers_settings() -> None:
    assert len(RULER_TASKS) == 13
    assert {SPECS[t].metric for t in ("qa_1", "qa_2")} == {"string_match_part"}
    assert {SPECS[t].tokens for t in RULER_TASKS} == {128, 30, 120, 50, 32}
    assert SPECS["niah_multikey_3"].options["key"] == SPECS["niah_multikey_3"].options["value"] == "uuids"
    assert label("qa_1") == "qa_1 (synthetic)" and label("vt") == "vt" and "not SQuAD" in SUBSTITUTES["qa_1"]
    assert "Shakespeare" in SUBSTITUTES["niah_single_2"] and "niah_single_1" not in SUBSTITUTES  # repeat haystack


@pytest.mark.parametrize("task", RULER_TASKS)
def test_each_task_fits_splits_and_holds_its_answers(tokenizer, samples, task: str) -> None:
    s = samples[task]
    context_ids, question_ids = split_ids(tokenizer, s)
    n = len(context_ids) + len(question_ids)
    assert n == s.metadata["prompt_tokens"]
    room = LENGTH - SPECS[task].tokens  # RULER: prompt + answer tokens within the length
    assert 0.9 * room <= n <= room
    assert s.prompt == s.context + s.question and s.metric == SPECS[task].metric
    assert s.question.endswith(s.metadata["answer_prefix"])
    assert s.prompt.rindex(s.metadata["question_only"]) == len(s.context)  # the question starts where the context ends
    if task != "cwe":  # cwe's worked example (RULER's few-shot) asks the same question inside the context
        assert s.metadata["question_only"] not in s.context
    for answer in s.answers:  # each gold is in the context as scored, and never in the question
        assert answer.lower() in s.context.lower() and answer.lower() not in s.question.lower()
    assert score(s, " " + " ".join(s.answers)) == 1.0 and score(s, " none") == 0.0


def test_same_seed_same_sample_and_datasets_are_prefixes(tokenizer) -> None:
    for task in ("niah_multikey_2", "vt", "qa_2"):
        a, b, c = build(tokenizer, task, 11), build(tokenizer, task, 11), build(tokenizer, task, 12)
        assert (a.prompt, a.answers) == (b.prompt, b.answers) and a.prompt != c.prompt
    two = make_ruler_dataset("fwe", 2, 700, tokenizer=tokenizer, haystack=HAYSTACK, seed=1, words=WORDS)
    three = make_ruler_dataset("fwe", 3, 700, tokenizer=tokenizer, haystack=HAYSTACK, seed=1, words=WORDS)
    assert [s.prompt for s in two] == [s.prompt for s in three[:2]]


def test_needle_tasks_follow_rulers_shapes(samples) -> None:
    needles = {t: re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", samples[t].context)
               for t in RULER_TASKS if t.startswith("niah")}  # fmt: skip
    assert len(needles["niah_multikey_1"]) == 4 and len(needles["niah_multivalue"]) == 4
    assert len({k for _, k, _ in needles["niah_multivalue"]}) == 1  # one key, four values
    assert len(samples["niah_multiquery"].answers) == 4 and ", and " in samples["niah_multiquery"].question
    assert len(needles["niah_multikey_2"]) > 10 and len({k for _, k, _ in needles["niah_multikey_2"]}) == len(
        needles["niah_multikey_2"])  # a haystack of needles, every key once  # fmt: skip
    assert re.fullmatch(r"[0-9a-f-]{36}", needles["niah_multikey_3"][0][1])  # uuid keys
    assert "The grass is green." in samples["niah_single_1"].context
    single = samples["niah_single_2"].question
    assert single.startswith("What is the special magic number for") and single.endswith("text is")


def test_word_tasks_counts(samples) -> None:
    vt = samples["vt"]
    value = vt.metadata["query_value"]
    chain = [f"VAR {vt.answers[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(vt.answers, vt.answers[1:])]
    assert all(line in vt.context for line in chain) and len(vt.answers) == 5
    assert vt.context.index(" ".join(vt.metadata["example_answer"])) < vt.context.index(chain[0])  # few-shot first
    listing = re.split(r"\n", samples["cwe"].context)[-2]  # the real list, after the worked example
    counts = Counter(re.findall(r"\d+\. (\w+)", listing))
    assert {w for w, _ in counts.most_common(10)} == set(samples["cwe"].answers)
    assert set(counts[w] for w in samples["cwe"].answers) == {6}  # RULER's short-length counts
    words = Counter(samples["fwe"].context.split())
    top = [w for w, _ in words.most_common(4)]
    assert top[0] == "..." and top[1:] == samples["fwe"].answers
    assert _zeta(2.0) == pytest.approx(torch.pi**2 / 6, abs=1e-9)


def test_synthetic_qa_needs_the_facts(samples) -> None:
    qa1, qa2 = samples["qa_1"], samples["qa_2"]
    assert qa1.context.count("Document ") == qa1.metadata["documents"] >= 3
    assert qa1.metadata["facts"][0] in qa1.context and len(qa1.metadata["facts"]) >= 3  # distractor facts too
    bridge = qa2.metadata["facts"][:2]
    assert all(f in qa2.context for f in bridge) and qa2.answers[0] in bridge[1]
    assert qa2.question.startswith("Answer the question") and qa2.question.endswith("born? Answer:")


def test_scoring_rules_on_hand_written_outputs() -> None:
    assert string_match_all("8821, 7702 and 1234", ["8821", "7702", "9999", "1234"]) == 0.75
    assert string_match_part("I think it was ada KETTLESON.", ["Ada Kettleson", "Kettleson"]) == 1.0
    assert string_match_part("no idea", ["Ada Kettleson", "Kettleson"]) == 0.0
    qa = Sample("p", ["Ada Kettleson", "Kettleson"], "qa_1", 100, None, metric="string_match_part")
    mv = Sample("p", ["1111111", "2222222"], "niah_multivalue", 100, None)
    assert score(qa, " Kettleson\x07") == 1.0 and score(mv, " 2222222\n") == 0.5
    with pytest.raises(ValueError, match="unknown metric"):
        score(Sample("p", ["x"], "vt", 10, None, metric="bleu"), "x")


def test_too_short_a_length_is_one_clear_error(tokenizer) -> None:
    with pytest.raises(ValueError, match="tokens are too few for this task"):
        build(tokenizer, "cwe", length=400)


@pytest.fixture
def one_thread():
    """One torch thread: a tiny model's calls are microseconds, and two threads on shared, busy cores spin for ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_both_settings_answer_as_direct_calls_would(tokenizer, one_thread) -> None:
    """Query-aware: context + question in one call; query-agnostic: the context compressed alone, then the question
    as the cache's next call. The shared prefill gives the answers direct calls give, on the ids split_ids makes,
    with what follows the compressed prompt (the question when agnostic, the answer) appended: `headroom`."""
    model = tiny_model(tokenizer, context=2048)
    model.generation_config.eos_token_id = None
    samples = [
        build(tokenizer, "niah_single_1", seed=4, length=420),
        build(tokenizer, "niah_multikey_2", seed=4, length=420),
    ]
    configs = [("full", None), ("snapkv", 0.25), ("h2o", 0.125)]
    for agnostic in (False, True):
        rows = run_shared(model, tokenizer, samples, configs, cells=_NoCells(), gen_cap=4, agnostic=agnostic)
        assert {(r["policy"], r["subtask"]) for r in rows} == {(p, s.task) for p, _ in configs for s in samples}
        for s in samples:
            c, q = split_ids(tokenizer, s)
            compressed = c if agnostic else c + q
            headroom = (len(q) if agnostic else 0) + answer_tokens(s.task, 4)
            for policy, budget in configs:
                cache = new_cache(policy, budget, len(compressed), headroom=headroom)  # a fraction of the compressed
                logits = prefill(model, cache, torch.tensor([compressed]))
                cache.end_prompt()
                if agnostic:  # the question: the cache's next call, at the positions after the context
                    logits = prefill(model, cache, torch.tensor([q]), start=len(c))
                out = greedy_continue(model, cache, logits, len(c) + len(q), 4)
                answer = tokenizer.decode(out, skip_special_tokens=True)
                assert _NoCells.answers[(s.metadata["seed"], s.task, policy, agnostic)] == answer, (policy, agnostic)


def test_a_policy_with_its_own_pass_reads_the_context_itself(tokenizer, one_thread, monkeypatch) -> None:
    """KVzip cannot take the recorded prefill (it ranks by repeating the context): the shared path records its pass
    (h2o_kv.compress, once per prompt) and answers the question as a direct run does; it is just another entry of the
    study, and alone it costs no recorded prefill."""
    compress = pytest.importorskip("h2o_kv.runtime.compress").compress
    model = tiny_model(tokenizer, context=2048)
    model.generation_config.eos_token_id = None
    sample = build(tokenizer, "niah_single_1", seed=6, length=420)
    monkeypatch.setattr("h2o_kv.studies.eval.shared.record_prefill", lambda *a: pytest.fail("recorded for nothing"))
    run_shared(model, tokenizer, [sample], [("kvzip", 0.25)], cells=_NoCells(), gen_cap=4, agnostic=True)
    c, q = split_ids(tokenizer, sample)
    headroom = len(q) + answer_tokens(sample.task, 4)
    cache = compress(model, torch.tensor([c]), cache=new_cache("kvzip", 0.25, len(c), headroom=headroom),
                     tokenizer=tokenizer)  # fmt: skip
    logits = prefill(model, cache, torch.tensor([q]), start=len(c))
    direct = tokenizer.decode(greedy_continue(model, cache, logits, len(c) + len(q), 4), skip_special_tokens=True)
    assert _NoCells.answers[(sample.metadata["seed"], sample.task, "kvzip", True)] == direct


class _NoCells:
    """Stores nothing, remembers each answer (by sample, policy and setting) for the comparison."""

    answers: dict = {}

    def stored(self, name):
        return None

    def put(self, name, rows):
        key = (name["sample_seed"], name["subtask"], name["policy"], name.get("setting") == "agnostic")
        _NoCells.answers[key] = rows[0]["answer"]


def test_settings_and_task_lists_are_checked(tokenizer, monkeypatch) -> None:
    ruler = SIZES["ruler4k"].retrieval
    assert ruler.tasks == RULER_TASKS and ruler.prefills == ("oneshot", "agnostic") and ruler.answer_cap is None
    check_retrieval(ruler)
    older = SIZES["qwen"].retrieval
    with pytest.raises(ValueError, match="query-agnostic needs RULER's thirteen tasks"):
        check_retrieval(type(older)(**{**older.__dict__, "prefills": ("agnostic",)}))
    monkeypatch.setattr("h2o_kv.studies.eval.ruler_tasks.load_words", lambda: WORDS)  # no fetch in tests
    samples = make_samples(tokenizer, HAYSTACK, tasks=["passkey", "vt"], context_tokens=800, n=1, seed=0)
    assert [s.task for s in samples] == ["passkey", "vt"] and not samples[0].question and samples[1].question
    assert split_ids(tokenizer, samples[0]) == (tokenizer(samples[0].prompt)["input_ids"], [])
    direct = make_ruler_dataset("vt", 1, 800, tokenizer=tokenizer, haystack=HAYSTACK, seed=1000 * 13, words=WORDS)
    assert samples[1].prompt == direct[0].prompt  # task k of TASKS + RULER_TASKS is seeded seed + 1000 k


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--setting", "query-agnostic", "--retrieval-tasks", "passkey"], "query-agnostic needs RULER's thirteen"),
        (["--setting", "both", "--prefills", "oneshot"], "--setting or --prefills"),
        (["--retrieval-tasks", "ruler,quiz"], "--retrieval-tasks"),
    ],
)
def test_bad_ruler_flags_are_one_line_before_loading(argv, message, monkeypatch, capsys) -> None:
    from h2o_kv import cli
    from h2o_kv.runtime import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded for bad input"))
    code = cli.main(["eval", "--tasks", "retrieval", "--size", "ruler4k", *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_samples_run_round_by_round_over_the_tasks():
    """`by_rounds`: each (task, context)'s first sample, then each one's second, so a run stopped partway holds every
    task's first samples; a task with fewer samples drops out of the later rounds, each task's own order kept."""
    from types import SimpleNamespace

    from h2o_kv.studies.eval.retrieval import by_rounds

    samples = [SimpleNamespace(task=t, context_tokens=c, i=i)
               for t, c, n in (("qa_1", 4096, 3), ("qa_2", 4096, 1), ("qa_1", 2048, 2)) for i in range(n)]  # fmt: skip
    order = [(s.task, s.context_tokens, s.i) for s in by_rounds(samples)]
    assert order == [("qa_1", 4096, 0), ("qa_2", 4096, 0), ("qa_1", 2048, 0), ("qa_1", 4096, 1), ("qa_1", 2048, 1),
                     ("qa_1", 4096, 2)]  # fmt: skip

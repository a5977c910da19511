"""RULER-style retrieval generators and scoring (h2o_kv.studies.eval.retrieval), checked without a model.

The haystack is made-up text (seeded pseudo-words in sentences); token counts use whitespace words
or a chars/4 estimate, so every expected value can be recomputed here by re-parsing the prompt.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable

import pytest

from h2o_kv.studies.eval.ruler import (
    RULER_TASKS,
    TASKS,
    TOKENS_TO_GENERATE,
    Sample,
    make_dataset,
    make_sample,
    max_new_tokens,
    score,
    string_match_all,
)

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def _make_haystack(n_sentences: int = 900, vocab_size: int = 3000, seed: int = 7) -> str:
    rng = random.Random(seed)
    syllables = [
        "ka",
        "lo",
        "mi",
        "ren",
        "tu",
        "sa",
        "vel",
        "or",
        "ni",
        "pa",
        "dro",
        "que",
        "zen",
        "fa",
        "bri",
    ]
    vocab = list(dict.fromkeys("".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(vocab_size)))
    sentences = []
    for _ in range(n_sentences):
        words = rng.choices(vocab, k=rng.randint(4, 14))
        sentences.append(" ".join(words).capitalize() + rng.choice(".....!?"))
    # line breaks like a play script; generators must cope with them
    return "\n".join(" ".join(sentences[i : i + 3]) for i in range(0, len(sentences), 3))


HAYSTACK = _make_haystack()


def words_len(text: str) -> int:
    return len(text.split())


def chars_len(text: str) -> int:
    return (len(text) + 3) // 4


def _sample(task: str, context_tokens: int = 1500, seed: int = 0, **kw) -> Sample:
    kw.setdefault("tokenizer_len", words_len)
    return make_sample(task, context_tokens=context_tokens, haystack=HAYSTACK, seed=seed, **kw)


def _context(sample: Sample) -> str:
    """The filler part of a prompt: header, context and question are on separate lines."""
    return max(sample.prompt.split("\n"), key=len)


# --------------------------------------------------------------------------------------- scoring


def test_string_match_all_is_fraction_found_case_insensitive() -> None:
    assert string_match_all("The values are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0
    assert string_match_all("nothing here", ["123"]) == 0.0


def test_generation_lengths_follow_ruler() -> None:
    assert set(TASKS) == set(TOKENS_TO_GENERATE)
    assert max_new_tokens("variable_tracking") == 30
    with pytest.raises(ValueError):
        max_new_tokens("nope")


def test_score_uses_task_metric() -> None:
    vt = _sample("variable_tracking")
    assert score(vt, " " + ", ".join(vt.answers)) == 1.0
    assert score(vt, " " + vt.answers[0]) == pytest.approx(1 / len(vt.answers))  # all, not part
    assert score(vt, " I do not know") == 0.0
    with pytest.raises(ValueError, match="no metric"):
        score(Sample(prompt="q", answers=["Paris"], task="qa", context_tokens=10, depth=None), "paris")
    nk = _sample("niah_single")
    assert score(nk, f" {nk.answers[0]}.") == 1.0
    assert score(nk, " 0000000.") == 0.0


# ----------------------------------------------------------------------------------- generators


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_sample_different_seed_different(task: str) -> None:
    a, b, c = _sample(task, seed=11), _sample(task, seed=11), _sample(task, seed=12)
    assert a.prompt == b.prompt and a.answers == b.answers and a.depth == b.depth
    assert a.prompt != c.prompt
    assert a.answers != c.answers


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("context_tokens", [400, 1500, 5000])
@pytest.mark.parametrize("tokenizer_len", [words_len, chars_len], ids=["words", "chars"])
def test_prompt_length_just_below_budget(task: str, context_tokens: int, tokenizer_len: Callable) -> None:
    s = _sample(task, context_tokens, seed=3, tokenizer_len=tokenizer_len)
    n = tokenizer_len(s.prompt)
    assert n == s.metadata["prompt_tokens"]
    assert 0.97 * context_tokens <= n <= context_tokens
    assert s.context_tokens == context_tokens


@pytest.mark.parametrize("task", TASKS)
def test_fitting_uses_a_bounded_number_of_tokenizer_calls(task: str) -> None:
    calls = []

    def counting(text: str) -> int:
        calls.append(len(text))
        return chars_len(text)

    _sample(task, 8000, tokenizer_len=counting)
    assert len(calls) <= 20


@pytest.mark.parametrize("task", TASKS)
def test_prompt_ends_with_answer_prefix(task: str) -> None:
    s = _sample(task)
    assert s.prompt.endswith(s.metadata["answer_prefix"])
    assert s.metadata["max_new_tokens"] == TOKENS_TO_GENERATE[task]
    tail = s.prompt.split("\n")[-1]
    for ans in s.answers:  # the answer must come from the context, not from the question
        assert ans not in tail


def test_passkey_template() -> None:
    s = _sample("passkey", depth=0.3)
    (key,) = s.answers
    assert re.fullmatch(r"\d{5}", key)
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.prompt
    assert s.prompt.endswith("What is the pass key? The pass key is")


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_needle_at_requested_depth(task: str, depth: float) -> None:
    s = _sample(task, 3000, seed=5, depth=depth)
    ctx = _context(s)
    needle = s.metadata["needle"]
    assert s.answers[0] in needle
    assert ctx.count(needle) == 1
    pos = ctx.index(needle) / len(ctx)
    assert abs(pos - depth) < 0.03, (pos, depth)
    assert s.depth == depth


def test_depth_none_is_drawn_from_seed() -> None:
    depths = {_sample("niah_single", seed=k).depth for k in range(6)}
    assert len(depths) == 6 and all(0.0 <= d <= 1.0 for d in depths)
    assert _sample("variable_tracking").depth is None


def test_niah_single_has_exactly_one_needle() -> None:
    s = _sample("niah_single")
    found = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", s.prompt)
    assert len(found) == 1
    key, value = found[0]
    assert re.fullmatch(r"\d{7}", value) and s.answers == [value]
    assert f"What are all the special magic numbers for {key} mentioned" in s.prompt


@pytest.mark.parametrize("value_kind", ["number", "uuid"])
def test_niah_multikey_distractors(value_kind: str) -> None:
    s = _sample("niah_multikey", 2500, seed=9, value_kind=value_kind, num_keys=4)
    kind = "numbers" if value_kind == "number" else "uuids"
    found = re.findall(rf"One of the special magic {kind} for (\S+) is: ([0-9a-f-]+)\.", s.prompt)
    assert len(found) == 4
    keys = [k for k, _ in found]
    values = [v for _, v in found]
    assert len(set(keys)) == 4 and len(set(values)) == 4
    query = re.search(rf"What are all the special magic {kind} for (\S+) mentioned", s.prompt).group(1)
    assert keys.count(query) == 1
    assert s.answers == [dict(found)[query]]
    assert sorted(s.metadata["distractor_keys"]) == sorted(k for k in keys if k != query)
    for v in values:
        if value_kind == "uuid":
            assert UUID_RE.match(v)
        else:
            assert re.fullmatch(r"\d{7}", v)


def _solve_variable_tracking(prompt: str) -> tuple[str, set[str], list[str]]:
    """Re-parse the assignments in prompt order and return (query value, vars holding it, order)."""
    value_of: dict[str, str] = {}
    order = []
    for m in re.finditer(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))", prompt):
        var, ref, num = m.groups()
        assert var not in value_of, "variable assigned twice"
        if ref is not None:
            assert ref in value_of, "chain used before it was defined"
            value_of[var] = value_of[ref]
        else:
            value_of[var] = num
        order.append(var)
    query = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
    return query, {v for v, x in value_of.items() if x == query}, order


@pytest.mark.parametrize("num_chains,num_hops", [(1, 4), (3, 2), (2, 6)])
def test_variable_tracking_answers_correct_by_construction(num_chains: int, num_hops: int) -> None:
    s = _sample("variable_tracking", 2000, seed=4, num_chains=num_chains, num_hops=num_hops)
    query, holders, order = _solve_variable_tracking(s.prompt)
    assert len(order) == num_chains * (num_hops + 1)
    assert set(s.answers) == holders and len(s.answers) == num_hops + 1
    assert f"{num_hops + 1} variables are assigned the value {query}" in s.prompt
    # a chain of hops, as in RULER: each variable is assigned from the previous one
    assert f"VAR {s.answers[0]} = {query}." in s.prompt
    for prev, nxt in zip(s.answers, s.answers[1:], strict=False):
        assert f"VAR {nxt} = VAR {prev}." in s.prompt
    for var in s.answers:
        assert re.fullmatch(r"[A-Z]{5}", var)
        assert s.prompt.count(var) >= 1


def _cwe_counts(prompt: str) -> Counter:
    listing = prompt.split("\n")[1]
    items = re.findall(r"(\d+)\. ([a-z]+)", listing)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))  # numbered 1..N
    return Counter(w for _, w in items)


@pytest.mark.parametrize("context_tokens,tokenizer_len", [(600, words_len), (3000, words_len), (4096, chars_len)])
def test_common_words_answers_are_the_most_frequent(context_tokens: int, tokenizer_len: Callable) -> None:
    s = _sample("common_words", context_tokens, seed=2, tokenizer_len=tokenizer_len)
    counts = _cwe_counts(s.prompt)
    k = len(s.answers)
    assert k == 10 and len(set(s.answers)) == k
    ranked = counts.most_common()
    assert {w for w, _ in ranked[:k]} == set(s.answers)
    assert ranked[k - 1][1] > ranked[k][1]  # strictly separated from the rest
    assert all(counts[w] == s.metadata["common_freq"] for w in s.answers)
    assert s.metadata["num_uncommon"] > 50
    assert "What are the 10 most common words" in s.prompt


def test_common_words_needs_enough_vocabulary() -> None:
    tiny = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau."
    with pytest.raises(ValueError, match="vocabulary"):
        make_sample("common_words", context_tokens=2000, tokenizer_len=words_len, haystack=tiny, seed=0)


def test_short_haystack_is_cycled() -> None:
    short = "The quick brown fox jumps over the lazy dog. A second sentence follows here!"
    s = make_sample("niah_single", context_tokens=500, tokenizer_len=words_len, haystack=short, seed=1)
    assert 0.97 * 500 <= words_len(s.prompt) <= 500
    assert s.prompt.count("lazy dog.") > 10


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        _sample("needle")
    with pytest.raises(ValueError, match="too small"):
        _sample("niah_multikey", context_tokens=40)
    with pytest.raises(ValueError, match="depth"):
        _sample("passkey", depth=1.5)
    with pytest.raises(ValueError, match="value_kind"):
        _sample("niah_single", value_kind="word")
    with pytest.raises(ValueError, match="empty"):
        make_sample("passkey", context_tokens=100, tokenizer_len=words_len, haystack="  \n", seed=0)


def test_make_dataset_seeds_and_depth_sweep() -> None:
    kw = dict(tokenizer_len=words_len, haystack=HAYSTACK, seed=42)
    big = make_dataset("niah_single", 6, 800, **kw)
    small = make_dataset("niah_single", 3, 800, **kw)
    assert len(big) == 6
    assert [s.prompt for s in small] == [s.prompt for s in big[:3]]  # prefix-stable
    assert len({s.metadata["seed"] for s in big}) == 6
    assert len({s.answers[0] for s in big}) == 6
    assert make_dataset("niah_single", 6, 800, **{**kw, "seed": 43})[0].prompt != big[0].prompt
    swept = make_dataset("passkey", 4, 800, depth=[0.0, 0.5], **kw)
    assert [s.depth for s in swept] == [0.0, 0.5, 0.0, 0.5]
    mk = make_dataset("niah_multikey", 2, 800, num_keys=3, **kw)
    assert all(len(s.metadata["distractor_keys"]) == 2 for s in mk)


def test_side_by_side_sizes_build_the_kvpress_export_samples(tiny_tokenizer):
    """`--size niah` and `--size ruler` build, sample for sample, what compare/kvpress exports for kvpress."""
    import importlib.util
    from pathlib import Path

    from h2o_kv.studies.eval.retrieval import make_samples
    from h2o_kv.studies.eval.sizes import SIZES

    path = Path(__file__).resolve().parents[2] / "compare" / "kvpress" / "export_samples.py"
    spec = importlib.util.spec_from_file_location("export_samples", path)
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    haystack = _make_haystack()
    for size in ("niah", "ruler"):
        ret = SIZES[size].retrieval
        assert ret.samples == 20 and ret.contexts == (1024, 2048) and ret.prefills == ("oneshot",)
        ours = make_samples(tiny_tokenizer, haystack, tasks=ret.tasks, context_tokens=512, n=4, seed=3)
        theirs = [s for task in ret.tasks for s in export.samples_for(tiny_tokenizer, haystack, task, 512, 4, 3)]
        assert [(s.prompt, s.answers, s.depth) for s in ours] == [(s.prompt, s.answers, s.depth) for s in theirs]
    assert set(SIZES["ruler"].retrieval.tasks) | {"niah_single"} | set(RULER_TASKS) == set(export.SHORT)


def test_kvpress_summary_reports_the_run_time_it_recorded():
    """compare/kvpress/summary.py: the runner's per-sample seconds become a run-time line; none recorded, none shown."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "compare" / "kvpress" / "summary.py"
    spec = importlib.util.spec_from_file_location("kvpress_summary", path)
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    one = {"score": 1.0, "kv_bytes": 10, "kv_tokens": 1, "kv_tokens_effective": 1, "prefill_s": 0.1, "decode_s": 0.1}
    records = [{"id": f"niah-1024-0{i}", "task": "niah_single", "context_tokens": 1024,
                "h2o_kv_budget_tokens": {"0.2": 200}} for i in range(2)]  # fmt: skip
    state = {"cells": {"full": {"press": "full", "ratio": None, "task": "niah_single", "context": 1024,
                                "samples": {r["id"]: one for r in records}}}}  # fmt: skip
    assert "Run time" not in summary.markdown(summary.rows(state, records), state, records)
    state["seconds"] = {"niah-1024-00": 60.0, "niah-1024-01": 120.0}
    text = summary.markdown(summary.rows(state, records), state, records)
    assert "Run time: 3.0 min over 2 samples (90 s per sample" in text

"""The accuracy evaluation: perplexity, fidelity, retrieval runs, summarisation and the runner's outputs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

import h2o_kv
from h2o_kv.policies import budget_tokens
from h2o_kv.runtime.generation import greedy_ids
from h2o_kv.studies.eval import parse_budgets
from h2o_kv.studies.eval.decoding import greedy_generate, new_cache, teacher_forced_top1
from h2o_kv.studies.eval.fidelity import compare, run_fidelity
from h2o_kv.studies.eval.perplexity import perplexity_stats, stream_nll, text_windows
from h2o_kv.studies.eval.retrieval import make_samples, mean_by_task, score_batch
from h2o_kv.studies.eval.ruler import Sample
from h2o_kv.studies.eval.run import run_eval
from h2o_kv.studies.eval.sizes import FidelitySize, PerplexitySize, RetrievalSize, Size, SummarizeSize
from h2o_kv.studies.eval.summarize import load_jsonl, run_summarize
from h2o_kv.studies.eval.tables import COLUMNS

from conftest import make_model, random_ids
from serve_helpers import tiny_model

WORDS = (
    "the king rode out at dawn with his men and the queen watched from the tower while the river ran "
    "past the walls of the old town where the people sang of war and of peace and of the long winter"
).split()


class WordTokenizer:
    """Decodes ids as space-separated numbers: enough for the metrics' hand-made cases."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tiny_lm(tokenizer):
    """A tiny random Llama with the bundled tokenizer's vocabulary, so text tasks run in seconds."""
    model = tiny_model(tokenizer, context=4096)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two plain-text 'plays' of pseudo-English, as a directory corpus."""
    root = tmp_path_factory.mktemp("corpus")
    for k in range(2):
        words = [WORDS[(i * 7 + k * 3 + i // 5) % len(WORDS)] for i in range(6000)]
        lines = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
        (root / f"play{k}.txt").write_text("\n\n".join(lines))
    return root


# ---------------------------------------------------------------------------------------- budgets


def test_budget_parsing_and_policies() -> None:
    assert parse_budgets("0.05,0.1,20%,128") == [0.05, 0.1, 0.2, 128]
    assert parse_budgets("1,1.0") == [1, 1.0]  # one token, the whole length
    assert budget_tokens(0.2, 1024) == 204 and budget_tokens(128, 1024) == 128 and budget_tokens(None, 5) is None
    assert budget_tokens(0.001, 100) == 1
    with pytest.raises(ValueError):
        budget_tokens(1.5, 10)
    for bad in ("0", "1.5", "nan", ""):
        with pytest.raises(ValueError):
            parse_budgets(bad)
    h2o = new_cache("h2o", 0.2, 1000).policy
    assert [int(t) for t in h2o.split(torch.tensor([1]))] == [100, 100]
    assert new_cache("local", 64, 1000).policy.window == 64
    assert int(new_cache("streamingllm", 3, 1000).policy._sinks(torch.tensor([1]))) == 2  # tiny budgets: fewer sinks
    assert isinstance(new_cache("full", None, 10).policy, h2o_kv.Full)


# ------------------------------------------------------------------------------------- perplexity


def test_full_perplexity_equals_stock_model_nll() -> None:
    ids = random_ids(2, 48)
    stock = make_model("llama", enable=False)
    with torch.no_grad():
        logits = stock(ids).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    nll = stream_nll(make_model("llama"), ids, "full", None, chunk=1)
    assert nll.shape == (2, 47)
    assert perplexity_stats(nll)["ppl"] == pytest.approx(math.exp(float(expected)), rel=1e-4)


def test_mask_and_drop_give_the_same_perplexity_and_eviction_changes_it() -> None:
    model, ids = make_model("llama"), random_ids(2, 40)
    drop = stream_nll(model, ids, "h2o", 8, mode="drop", chunk=1)
    mask = stream_nll(model, ids, "h2o", 8, mode="mask", chunk=1)
    full = stream_nll(model, ids, "full", None, chunk=1)
    torch.testing.assert_close(drop, mask, atol=1e-5, rtol=1e-5)
    assert torch.allclose(drop[:, :7], full[:, :7], atol=1e-5)  # nothing is evicted before the cache fills
    assert not torch.allclose(drop, full, atol=1e-3)


def test_text_windows_are_deterministic_and_from_each_text(tokenizer, corpus: Path) -> None:
    a = text_windows(tokenizer, str(corpus), n=4, length=64, seed=1)
    b = text_windows(tokenizer, str(corpus), n=4, length=64, seed=1)
    c = text_windows(tokenizer, str(corpus), n=4, length=64, seed=2)
    assert a.shape == (4, 64) and torch.equal(a, b) and not torch.equal(a, c)
    assert len({tuple(w.tolist()) for w in a}) == 4
    with pytest.raises(ValueError):
        text_windows(tokenizer, str(corpus / "play0.txt"), n=4, length=5000)


@pytest.mark.slow
def test_tiny_budget_raises_real_perplexity(tokenizer) -> None:
    model, _ = h2o_kv.load_model("smollm2-135m")
    windows = text_windows(tokenizer, None, n=1, length=160)
    full = perplexity_stats(stream_nll(model, windows, "full", None, chunk=8))["ppl"]
    tiny = perplexity_stats(stream_nll(model, windows, "local", 4, chunk=1))["ppl"]
    assert tiny > 1.5 * full


# --------------------------------------------------------------------------------------- fidelity


def test_compare_scores_hand_made_cases() -> None:
    tok = WordTokenizer()
    same = compare(tok, [[1, 2, 3, 4]], [[1, 2, 3, 4]])
    assert same == {"agree_tokens": 4, "agree_frac": 1.0, "rouge_l_vs_full": 1.0, "identical": 1.0}
    drift = compare(tok, [[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [7, 8]])
    assert drift["agree_tokens"] == 1.0  # (2 + 0) / 2
    assert drift["agree_frac"] == pytest.approx(0.25)  # (2/4 + 0/2) / 2
    assert drift["rouge_l_vs_full"] == pytest.approx((0.75 + 0.0) / 2)  # LCS 3 of 4 + 4 words
    assert drift["identical"] == 0.0


def test_fidelity_of_full_is_perfect_and_a_tiny_budget_drifts(tiny_lm, tokenizer) -> None:
    prompts = [f"Tell me about {w} and the " + " ".join(WORDS[i : i + 30]) for i, w in enumerate(WORDS[:3])]
    rows = run_fidelity(tiny_lm, tokenizer, prompts, [("full", None), ("local", 2)], max_new_tokens=12)
    full, local = rows
    assert full["agree_frac"] == full["rouge_l_vs_full"] == full["identical"] == 1.0
    assert full["agree_tokens"] == 12 and full["top1_vs_full"] == 1.0
    assert local["agree_frac"] < 1.0 and local["top1_vs_full"] < 1.0
    assert 0.0 <= local["rouge_l_vs_full"] <= 1.0


def test_teacher_forced_top1_batches_like_single_prompts(tiny_lm, tokenizer) -> None:
    prompts = [tokenizer(" ".join(WORDS[i : i + n]))["input_ids"] for i, n in ((0, 30), (5, 12), (9, 21))]
    full = greedy_generate(tiny_lm, tokenizer, prompts, "full", None, max_new_tokens=10)
    length = max(map(len, prompts))
    assert teacher_forced_top1(tiny_lm, prompts, full, "full", None, length=length) == [1.0, 1.0, 1.0]
    batched = teacher_forced_top1(tiny_lm, prompts, full, "h2o", 4, length=length)
    single = [teacher_forced_top1(tiny_lm, [p], [f], "h2o", 4, length=length)[0] for p, f in zip(prompts, full)]
    assert batched == pytest.approx(single) and min(batched) < 1.0


def test_greedy_generate_with_full_matches_stock_generate(tiny_lm, tokenizer) -> None:
    ids = tokenizer("the king rode out at dawn")["input_ids"]
    ours = greedy_generate(tiny_lm, tokenizer, [ids], "full", None, max_new_tokens=6)[0]
    with torch.no_grad():
        stock = tiny_lm.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert ours == stock[0, len(ids) :].tolist()


def test_batched_greedy_equals_each_prompt_alone(tiny_lm, tokenizer) -> None:
    """Left padding changes nothing: each row of a batch decodes as `generation.greedy_ids` does alone."""
    prompts = [tokenizer(" ".join(WORDS[i : i + n]))["input_ids"] for i, n in ((0, 30), (5, 12), (9, 21))]
    length = max(map(len, prompts))
    for policy, budget in (("full", None), ("h2o", 6), ("tova", 0.3)):
        batched = greedy_generate(tiny_lm, tokenizer, prompts, policy, budget, max_new_tokens=[8, 5, 8], length=length)
        alone = [greedy_ids(tiny_lm, new_cache(policy, budget, length), p, n) for p, n in zip(prompts, [8, 5, 8])]
        assert batched == alone, policy


# -------------------------------------------------------------------------------------- retrieval


def test_retrieval_scoring_on_hand_made_outputs() -> None:
    tok = WordTokenizer()
    samples = [
        Sample("...", ["w12"], "passkey", 100, 0.5),
        Sample("...", ["w7"], "passkey", 100, 0.5),
        Sample("...", ["w1", "w2"], "variable_tracking", 100, None),
    ]
    scores = score_batch(tok, samples, [[12, 3], [8], [2, 5]])
    assert scores == [1.0, 0.0, 0.5]
    assert mean_by_task(samples, scores) == {"passkey": (0.5, 2), "variable_tracking": (0.5, 1)}


def test_retrieval_samples_are_deterministic(tokenizer, corpus: Path) -> None:
    hay = (corpus / "play0.txt").read_text()
    kw = dict(tasks=("passkey", "niah_single"), context_tokens=200, n=2)
    a = make_samples(tokenizer, hay, seed=3, **kw)
    b = make_samples(tokenizer, hay, seed=3, **kw)
    c = make_samples(tokenizer, hay, seed=4, **kw)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.answers for s in a] != [s.answers for s in c]
    assert [s.task for s in a] == ["passkey", "passkey", "niah_single", "niah_single"]
    assert [s.depth for s in a] == [0.25, 0.75, 0.25, 0.75]
    assert all(s.metadata["prompt_tokens"] <= 200 for s in a)


# ---------------------------------------------------------------------------------- summarisation


def _jsonl(path: Path, n: int = 2) -> Path:
    lines = [
        json.dumps({"document": " ".join(WORDS[i : i + 40]), "summary": " ".join(WORDS[i : i + 6])}) for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_jsonl_checks_fields(tmp_path: Path) -> None:
    assert len(load_jsonl(_jsonl(tmp_path / "a.jsonl", 3), n=2)) == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="document"):
        load_jsonl(tmp_path / "bad.jsonl")


def test_summarize_on_tiny_jsonl(tiny_lm, tokenizer, tmp_path: Path) -> None:
    records = load_jsonl(_jsonl(tmp_path / "x.jsonl"))
    rows = run_summarize(tiny_lm, tokenizer, records, [("full", None), ("h2o", 0.1)], max_new_tokens=8)
    assert [r["policy"] for r in rows] == ["full", "h2o"]
    assert rows[0]["rouge_l_vs_full"] == 1.0
    assert all(0.0 <= r["rouge_l"] <= 1.0 and r["n"] == 2 for r in rows)


# ----------------------------------------------------------------------------------------- runner


def test_runner_writes_tables_and_plots(tiny_lm, tokenizer, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    small = Size(
        PerplexitySize(windows=2, length=96, chunk=8),
        RetrievalSize(("passkey",), (160,), samples=1, prefills=("oneshot", "stream"), chunk=16, answer_cap=4),
        FidelitySize(prompts=2, passage_tokens=40, new_tokens=4),
        SummarizeSize(records=2, new_tokens=4, document_tokens=40),
    )
    rows = run_eval(
        tiny_lm,
        tokenizer,
        tasks=["perplexity", "retrieval", "fidelity", "summarize"],
        policies=["h2o", "local"],
        budgets=[0.1, 0.5],
        corpus=str(corpus),
        data=str(_jsonl(tmp_path / "d.jsonl")),
        out_dir=out,
        progress=False,
        size=small,
        command="test",
    )
    for name in ("results.json", "results.csv", "summary.md", *(f"{t}.png" for t in ("perplexity", "retrieval"))):
        assert (out / name).is_file(), name
    assert (out / "fidelity.png").stat().st_size > 1000 and (out / "summarize.png").is_file()
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == COLUMNS
    assert len(table) == len(rows)
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["command"] == "test" and set(meta["seconds"]) == {"perplexity", "retrieval", "fidelity", "summarize"}
    assert meta["settings"]["perplexity"] == {"windows": 2, "length": 96, "chunk": 8}
    assert meta["environment"]["torch_threads"] >= 1
    ppl = [r for r in rows if r["task"] == "perplexity" and r["metric"] == "ppl"]
    assert {(r["policy"], r["budget_frac"], r["budget_tokens"]) for r in ppl} == {
        ("full", 1.0, 96), ("h2o", 0.1, 9), ("h2o", 0.5, 48), ("local", 0.1, 9), ("local", 0.5, 48)
    }  # fmt: skip
    assert all(r["vs_full"] == pytest.approx(1.0) for r in rows if r["policy"] == "full" and r["full_value"])
    retrieval = [r for r in rows if r["task"] == "retrieval"]
    assert {r["prefill"] for r in retrieval} == {"oneshot", "stream"}
    assert {r["subtask"] for r in retrieval} == {"passkey"}


def test_cli_registers_eval_subcommand() -> None:
    import argparse

    from h2o_kv.studies.eval import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--tasks", "perplexity", "--budgets", "64,128", "--mode", "mask"])
    assert args.func is cli.main and args.tasks == "perplexity" and args.mode == "mask"
    assert args.budgets == [64, 128]
    assert parser.parse_args(["eval"]).budgets == [0.05, 0.1, 0.2, 0.5]
    assert parser.parse_args(["eval", "--resume"]).resume and not parser.parse_args(["eval"]).resume
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--budgets", "0.1,1.5"])


def test_int8_policy_suffix_gives_int8_storage_with_close_logits(tiny_lm) -> None:
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = {name: new_cache(name, 0.5, 40) for name in ("h2o", "h2o-int8")}
    with torch.no_grad():
        logits = {name: tiny_lm(ids, past_key_values=c, use_cache=True).logits for name, c in caches.items()}
    assert caches["h2o-int8"].settings.kv_dtype == "int8" and caches["h2o"].settings.kv_dtype is None
    assert caches["h2o-int8"].nbytes() < 0.5 * caches["h2o"].nbytes()
    torch.testing.assert_close(logits["h2o-int8"], logits["h2o"], atol=0.05, rtol=0.05)


# ------------------------------------------------------------------------------------ stored cells


def _cell_run(tiny_lm, tokenizer, corpus: Path, out: Path, *, budgets, resume: bool, seed: int = 0) -> list[dict]:
    small = Size(
        PerplexitySize(windows=1, length=64, chunk=8),
        RetrievalSize(("passkey",), (160,), samples=1, prefills=("stream",), chunk=16, answer_cap=4),
        FidelitySize(prompts=1, passage_tokens=40, new_tokens=2),
        SummarizeSize(records=1, new_tokens=2, document_tokens=40),
    )
    return run_eval(tiny_lm, tokenizer, tasks=["perplexity", "retrieval"], policies=["h2o"], budgets=budgets,
                    corpus=str(corpus), out_dir=out, progress=False, size=small, seed=seed, resume=resume)  # fmt: skip


def _ppl(rows: list[dict]) -> dict:
    return {(r["policy"], r["budget"]): r["value"] for r in rows if r["task"] == "perplexity" and r["metric"] == "ppl"}


def test_finished_cells_are_stored_and_reused_only_when_resuming(tiny_lm, tokenizer, corpus: Path, tmp_path) -> None:
    out = tmp_path / "study"
    first = _cell_run(tiny_lm, tokenizer, corpus, out, budgets=[0.25], resume=False)
    stored = sorted((out / "cells").glob("*.json"))
    assert len(stored) == 4  # perplexity: full, h2o; retrieval (one context, streamed): full, h2o
    assert json.loads((out / "results.json").read_text())["meta"]["cells"] == {"ran": 4, "reused": 0}
    # Mark the stored H2O perplexity cell: a resumed run must return the mark, a fresh run must not.
    for path in stored:
        cell = json.loads(path.read_text())
        if '"task": "perplexity"' in cell["key"] and '"policy": "h2o"' in cell["key"]:
            cell["rows"][0]["ppl"] = 12345.0
            path.write_text(json.dumps(cell))
    resumed = _cell_run(tiny_lm, tokenizer, corpus, out, budgets=[0.25, 0.5], resume=True)
    assert _ppl(resumed)[("h2o", 0.25)] == 12345.0 and _ppl(resumed)[("full", None)] == _ppl(first)[("full", None)]
    assert _ppl(resumed)[("h2o", 0.5)] != 12345.0  # a new budget is a new cell: run, not taken from another
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["cells"] == {"ran": 2, "reused": 4}
    assert "4 reused" in (out / "summary.md").read_text()
    other_seed = _cell_run(tiny_lm, tokenizer, corpus, out, budgets=[0.25], resume=True, seed=1)
    assert _ppl(other_seed)[("h2o", 0.25)] != 12345.0  # another seed: another key
    fresh = _cell_run(tiny_lm, tokenizer, corpus, out, budgets=[0.25], resume=False)
    assert _ppl(fresh) == _ppl(first)  # without --resume every cell runs (and overwrites the stored one)


def test_an_unreadable_stored_cell_is_one_clear_error(tiny_lm, tokenizer, corpus: Path, tmp_path) -> None:
    out = tmp_path / "study"
    _cell_run(tiny_lm, tokenizer, corpus, out, budgets=[0.25], resume=False)
    broken = sorted((out / "cells").glob("*.json"))[0]
    broken.write_text('{"key": ')
    with pytest.raises(ValueError, match="unreadable.*delete it"):
        _cell_run(tiny_lm, tokenizer, corpus, out, budgets=[0.25], resume=True)


def test_cell_key_follows_the_source_code(tmp_path) -> None:
    from h2o_kv.studies.eval import cells as cells_mod

    calls = []
    store = cells_mod.Cells(tmp_path, {"code": "a"}, resume=True)
    assert store.get({"x": 1}, lambda: calls.append(1) or [{"v": 1}]) == [{"v": 1}]
    assert store.get({"x": 1}, lambda: calls.append(1) or [{"v": 2}]) == [{"v": 1}] and len(calls) == 1
    changed = cells_mod.Cells(tmp_path, {"code": "b"}, resume=True)  # the same cell after a code change
    assert changed.get({"x": 1}, lambda: calls.append(1) or [{"v": 3}]) == [{"v": 3}] and len(calls) == 2
    assert len(cells_mod.source_digest()) == 16 and cells_mod.source_digest() == cells_mod.source_digest()


def test_cells_resume_from_the_one_file_when_their_folder_is_gone(tmp_path) -> None:
    """A fresh clone has `cells.jsonl` (committed) and no `cells/` (git-ignored): resuming reads the file; a last line
    an interrupted append left without its newline is no cell, any other unreadable line is an error."""
    import shutil

    from h2o_kv.studies.eval import cells as cells_mod

    root, calls = tmp_path / "cells", []
    first = cells_mod.Cells(root, {"code": "a"}, resume=True)
    for x in (1, 2):
        first.get({"x": x}, lambda x=x: calls.append(x) or [{"v": x}])
    shutil.rmtree(root)
    bundle = tmp_path / "cells.jsonl"
    with open(bundle, "a") as f:
        f.write('{"key": "half a li')  # an interrupted append
    again = cells_mod.Cells(root, {"code": "a"}, resume=True)
    assert [again.get({"x": x}, lambda: calls.append(0) or []) for x in (1, 2)] == [[{"v": 1}], [{"v": 2}]]
    assert calls == [1, 2] and again.reused == 2
    assert cells_mod.Cells(root, {"code": "b"}, resume=True).get({"x": 1}, lambda: [{"v": 9}]) == [{"v": 9}]
    assert bundle.read_text().count("\n") == 3 and "half a li" not in bundle.read_text()  # cut off, then appended
    bundle.write_text('{"key": \n' + bundle.read_text())  # unreadable in the middle: an error naming the line
    with pytest.raises(ValueError, match="line 1 is unreadable"):
        cells_mod.Cells(root, {"code": "a"}, resume=True).stored({"x": 3})

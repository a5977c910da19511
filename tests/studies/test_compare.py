"""The scripts under compare/ that put h2o-kv's and kvpress's results side by side, run on made-up results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h2o_kv.studies.eval.cells import Cells

COMPARE = Path(__file__).resolve().parents[2] / "compare"


def test_side_by_side_merges_runs_later_cells_replacing_earlier_ones(tmp_path):
    """compare/side_by_side.py over two runs per library: a cell in both comes from the later file, one in only the
    earlier file stays; the verdict compares h2o-kv's best with kvpress's best press at or below its bytes."""

    def ours(path, cells):  # {(task, context, fraction, policy): (score, bytes, n)}
        rows = [{"task": "retrieval", "prefill": "oneshot", "subtask": t, "length": c, "budget_frac": f,
                 "policy": p, "metric": m, "value": v, "n": n}
                for (t, c, f, p), (score, nbytes, n) in cells.items()
                for m, v in (("score", score), ("kv_bytes", nbytes))]  # fmt: skip
        path.write_text(json.dumps({"meta": {"model": "/cache/models/qwen-a"}, "rows": rows}))

    def theirs(path, cells):  # {(task, context, ratio, press): [scores]}
        out = {f"{i}": {"press": p, "ratio": r, "task": t, "context": c,
                        "samples": {f"s{j}": {"score": v, "kv_bytes": 100.0} for j, v in enumerate(vs)}}
               for i, ((t, c, r, p), vs) in enumerate(cells.items())}  # fmt: skip
        path.write_text(json.dumps({"cells": out}))

    old = {
        ("passkey", 2048, 1.0, "full"): (1.0, 500.0, 10),
        ("passkey", 2048, 0.2, "snapkv"): (0.5, 100.0, 10),
        ("niah_single", 4096, 1.0, "full"): (1.0, 900.0, 10),
        ("niah_single", 4096, 0.2, "h2o"): (0.1, 180.0, 10),
    }
    new = {("niah_single", 4096, 1.0, "full"): (1.0, 900.0, 20), ("niah_single", 4096, 0.2, "h2o"): (0.9, 180.0, 20)}
    ours(tmp_path / "a.json", old)
    ours(tmp_path / "b.json", new)
    theirs(
        tmp_path / "ka.json", {("passkey", 2048, 0.8, "snapkv"): [1.0, 0.0], ("niah_single", 4096, 0.8, "tova"): [1.0]}
    )
    theirs(tmp_path / "kb.json", {("niah_single", 4096, 0.8, "tova"): [0.0, 1.0, 0.0, 0.0]})
    script = COMPARE / "side_by_side.py"
    args = ["--h2o", tmp_path / "a.json", tmp_path / "b.json", "--kvpress", tmp_path / "ka.json", tmp_path / "kb.json"]
    subprocess.run([sys.executable, script, *map(str, args), "--out", str(tmp_path / "s.md")], check=True)
    text = (tmp_path / "s.md").read_text()
    assert "| h2o-kv h2o | 0.90 | 0.0 | 20 |" in text and "| kvpress tova | 0.25 | 0.0 | 4 |" in text
    assert (
        "h2o-kv's best: **h2o 0.90**" in text
        and "at or above kvpress's best press at or below its bytes (tova 0.25" in text
    )
    assert "h2o-kv's best: **snapkv 0.50**" in text and "at or below its bytes (snapkv 0.50" in text
    assert "(tova 0.25, 0.0 MiB; 4 samples to h2o-kv's 20)" in text  # counts that differ, said
    assert "(snapkv 0.50, 0.0 MiB; 2 samples to h2o-kv's 10)" in text
    assert "Model: `qwen-a`." in text  # kvpress's files record none here; h2o-kv's names it
    (tmp_path / "kc.json").write_text(json.dumps({"meta": {"model_dir": "/cache/models/qwen-b"}, "cells": {}}))
    args[-1] = tmp_path / "kc.json"  # a kvpress run of another model: refused in one line
    run = subprocess.run([sys.executable, script, *map(str, args), "--out", str(tmp_path / "t.md")],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "the inputs ran different models" in run.stderr and "qwen-b" in run.stderr
    assert not (tmp_path / "t.md").exists()


def test_side_by_side_keeps_each_runs_full_and_cuts_kvpress_to_the_same_samples(tmp_path):
    """A run at 25 % with 10 samples merged over one at every fraction with 5: each fraction is read against the Full
    of the run its cells came from, and with --match-samples each kvpress cell's mean is over its first n samples,
    n being h2o-kv's count in that cell (kvpress's ids TASK-CONTEXT-NN, the same prefix of one sample set)."""

    def ours(path, full, cells, n):
        rows = [{"task": "retrieval", "prefill": "agnostic", "subtask": "qa_1", "length": 4096, "budget_frac": f,
                 "policy": p, "metric": "score", "value": v, "n": n}
                for (f, p), v in {(1.0, "full"): full, **cells}.items()]  # fmt: skip
        path.write_text(json.dumps({"rows": rows}))

    ours(tmp_path / "five.json", 0.8, {(0.5, "snapkv"): 0.8, (0.25, "snapkv"): 0.4}, 5)
    ours(tmp_path / "ten.json", 0.5, {(0.25, "snapkv"): 0.45}, 10)
    scores = {0.5: [0, 1, 1, 1, 1, 0, 0, 0, 0, 0], 0.75: [1] * 5 + [0] * 5}  # kvpress tova by ratio, samples 00-09
    press = {f"{r}": {"press": "tova", "ratio": r, "task": "qa_1", "context": 4096,
                      "samples": {f"qa_1-4096-{j:02d}": {"score": v, "kv_bytes": 1.0} for j, v in enumerate(vs)}}
             for r, vs in scores.items()}  # fmt: skip
    (tmp_path / "k.json").write_text(json.dumps({"cells": press}))
    args = ["--h2o", tmp_path / "five.json", tmp_path / "ten.json", "--kvpress", tmp_path / "k.json", "--prefill",
            "agnostic", "--match-samples", "--out", tmp_path / "s.md"]  # fmt: skip
    subprocess.run([sys.executable, COMPARE / "side_by_side.py", *map(str, args)], check=True)
    text = (tmp_path / "s.md").read_text()
    assert "### 50.0% of the prompt kept, 1 task(s); Full 0.800" in text  # the five-sample run's Full
    assert "### 25.0% of the prompt kept, 1 task(s); Full 0.500" in text  # the ten-sample run's
    assert "| h2o-kv snapkv | 0.450 | 90% | n/a | 10 |" in text
    assert "| kvpress tova | 0.800 | 100% | 0.0 | 5 |" in text  # ratio 0.5: samples 00-04 of its ten
    assert "| kvpress tova | 0.500 | 100% | 0.0 | 10 |" in text  # ratio 0.75: all ten
    bad = {"0": {**press["0.5"], "samples": {"first": {"score": 1.0, "kv_bytes": 1.0}}}}
    (tmp_path / "bad.json").write_text(json.dumps({"cells": bad}))  # ids without numbers: refused in one line
    args[args.index(tmp_path / "k.json")] = tmp_path / "bad.json"
    run = subprocess.run([sys.executable, COMPARE / "side_by_side.py", *map(str, args)], capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.strip().endswith("sample 'first' is not numbered (TASK-CONTEXT-NN): "
                                                               "--match-samples cannot cut it")  # fmt: skip
    per_task = text.split("### qa_1, 4096 tokens, 25% of the prompt")[1]  # the per-task tables read the same Fulls
    assert "100% of Full's 0.80 (meets 90 %)" in per_task and "90% of Full's 0.50 (meets 90 %)" in per_task


def test_side_by_side_reads_one_prefill_setting_and_any_kvpress_ratio(tmp_path):
    """`--prefill agnostic` (the compress-once study) reads h2o-kv's rows of that setting only, and kvpress's ratio
    0.75 is 25 % of the prompt kept (any ratio: 1 - ratio)."""
    rows = [{"task": "retrieval", "prefill": prefill, "subtask": "niah_multikey_1", "length": 4096, "budget_frac": f,
             "policy": p, "metric": m, "value": v, "n": 5}
            for prefill, score in (("oneshot", 0.9), ("agnostic", 0.6))
            for f, p in ((1.0, "full"), (0.25, "kvzipwhole"))
            for m, v in (("score", 1.0 if p == "full" else score), ("kv_bytes", 100.0))]  # fmt: skip
    (tmp_path / "h.json").write_text(json.dumps({"rows": rows}))
    press = {"0": {"press": "kvzip", "ratio": 0.75, "task": "niah_multikey_1", "context": 4096,
                   "samples": {"s": {"score": 0.5, "kv_bytes": 90.0}}}}  # fmt: skip
    (tmp_path / "k.json").write_text(json.dumps({"cells": press}))
    args = ["--h2o", tmp_path / "h.json", "--kvpress", tmp_path / "k.json", "--out", tmp_path / "s.md"]
    subprocess.run([sys.executable, COMPARE / "side_by_side.py", *map(str, args), "--prefill", "agnostic"], check=True)
    text = (tmp_path / "s.md").read_text()
    assert "### niah_multikey_1, 4096 tokens, 25% of the prompt" in text
    assert "| h2o-kv kvzipwhole | 0.60 |" in text and "| kvpress kvzip | 0.50 |" in text and "0.90" not in text


def test_per_sample_pairs_samples_by_seed_and_names_those_that_differ(tmp_path):
    """compare/per_sample.py pairs h2o-kv's stored cells (written by the eval's own Cells) with kvpress's
    per-sample scores through the samples file's seeds, per budget, and refuses cells of another model."""
    seeds = [11, 12]
    cells = Cells(tmp_path / "cells", {"model": "/cache/models/qwen-a", "seed": 0})
    for policy, budget, scores in (("tova", 0.1, [1.0, 0.0]), ("tova", 0.2, [1.0, 1.0]), ("h2o", 0.1, [0.0, 1.0])):
        for seed, value in zip(seeds, scores, strict=True):
            name = {"kind": "retrieval-sample", "subtask": "niah_single", "context": 2048, "sample_seed": seed,
                    "policy": policy, "budget": budget}  # fmt: skip
            cells.put(name, [{"answer": "x", "score": value, "kv_bytes": 1}])
    samples = [{"id": f"niah-2048-{i}", "task": "niah_single", "context_tokens": 2048, "seed": s}
               for i, s in enumerate(seeds)]  # fmt: skip
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    press = {"0": {"press": "tova_per_kv_head", "ratio": 0.9, "samples": {"niah-2048-0": {"score": 1.0},
                                                                          "niah-2048-1": {"score": 1.0}}},
             "1": {"press": "tova_per_kv_head", "ratio": 0.8, "samples": {"niah-2048-1": {"score": 1.0}}},
             "2": {"press": "full", "ratio": None, "samples": {"niah-2048-0": {"score": 1.0}}}}  # fmt: skip
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"meta": {"model_dir": "/elsewhere/qwen-a"}, "cells": press}))
    args = ["--h2o-cells", tmp_path / "cells", "--policy", "tova", "--kvpress", results, "--press",
            "tova_per_kv_head", "--samples", tmp_path / "samples.jsonl"]  # fmt: skip

    def per_sample() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, COMPARE / "per_sample.py", *map(str, args)], capture_output=True,
                              text=True)  # fmt: skip

    run = per_sample()
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "10% kept: 1 of 2 samples score the same, h2o-kv at or above in 1",
        "  niah-2048-1: h2o-kv 0.00, kvpress 1.00",
        "20% kept: 1 of 1 samples score the same, h2o-kv at or above in 1",
    ]
    # the best bounded policy per sample against the best press, from the cells.jsonl a long run commits
    lines = [(tmp_path / "cells" / name).read_text().strip() for name in sorted(os.listdir(tmp_path / "cells"))]
    (tmp_path / "cells.jsonl").write_text("\n".join(lines) + "\n")
    best = [sys.executable, COMPARE / "per_sample.py", "--h2o-cells", tmp_path / "cells.jsonl", "--policy", "best",
            "--kvpress", results, "--press", "best", "--samples", tmp_path / "samples.jsonl"]  # fmt: skip
    run = subprocess.run(list(map(str, best)), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "10% kept: 2 of 2 samples score the same, h2o-kv at or above in 2",
        "20% kept: 1 of 1 samples score the same, h2o-kv at or above in 1",
    ]
    results.write_text(json.dumps({"meta": {"model_dir": "/cache/models/qwen-b"}, "cells": press}))
    run = per_sample()
    assert run.returncode == 2 and "the cells ran qwen-a, kvpress ran qwen-b" in run.stderr
    # an earlier run's cell of the same sample and budget (another source digest) beside these: refused, not mixed
    results.write_text(json.dumps({"meta": {"model_dir": "/elsewhere/qwen-a"}, "cells": press}))
    Cells(tmp_path / "cells", {"model": "/cache/models/qwen-a", "seed": 0, "code": "old"}).put(
        {"kind": "retrieval-sample", "subtask": "niah_single", "context": 2048, "sample_seed": 12, "policy": "tova",
         "budget": 0.1}, [{"answer": "y", "score": 1.0, "kv_bytes": 1}])  # fmt: skip
    run = per_sample()
    assert run.returncode == 2 and "differ in code: the folder holds more than one run" in run.stderr, run.stderr


def test_side_by_side_averages_each_method_over_the_tasks_every_method_ran(tmp_path):
    """The leaderboard's view: per kept fraction, a method's mean over the tasks (only methods that ran every task),
    its share of Full's mean, and the bars at that level; `--plot` writes the picture."""
    cells = {  # (task, fraction, policy): score; bytes: 100 at 25 %, 40 at 10 %, Full 400
        ("qa_1", 1.0, "full"): 1.0, ("qa_2", 1.0, "full"): 0.5,
        ("qa_1", 0.25, "kvzipwindow"): 0.9, ("qa_2", 0.25, "kvzipwindow"): 0.5,
        ("qa_1", 0.25, "tova"): 1.0, ("qa_2", 0.25, "tova"): 0.0,
        ("qa_1", 0.1, "kvzipwindow"): 0.5, ("qa_2", 0.1, "kvzipwindow"): 0.1,
        ("qa_1", 0.1, "h2o"): 1.0,  # one task only: left out of the means
    }  # fmt: skip
    nbytes = {1.0: 400.0, 0.25: 100.0, 0.1: 40.0}
    rows = [{"task": "retrieval", "prefill": "agnostic", "subtask": t, "length": 4096, "budget_frac": f, "policy": p,
             "metric": m, "value": v, "n": 5}
            for (t, f, p), score in cells.items() for m, v in (("score", score), ("kv_bytes", nbytes[f]))]  # fmt: skip
    (tmp_path / "h.json").write_text(json.dumps({"rows": rows}))
    press = {  # kvzip masks (Full's bytes: never at or below h2o-kv's); keydiff drops
        f"{i}": {"press": p, "ratio": r, "task": t, "context": 4096,
                 "samples": {"s": {"score": v, "kv_bytes": 400.0 if p == "kvzip" else nbytes[round(1 - r, 6)]}}}
        for i, (p, r, t, v) in enumerate([("kvzip", 0.75, "qa_1", 1.0), ("kvzip", 0.75, "qa_2", 0.5),
                                          ("keydiff", 0.75, "qa_1", 0.5), ("keydiff", 0.75, "qa_2", 0.5),
                                          ("keydiff", 0.9, "qa_1", 0.0), ("keydiff", 0.9, "qa_2", 0.5)])
    }  # fmt: skip
    (tmp_path / "k.json").write_text(json.dumps({"cells": press}))
    args = ["--h2o", tmp_path / "h.json", "--kvpress", tmp_path / "k.json", "--out", tmp_path / "s.md"]
    subprocess.run([sys.executable, COMPARE / "side_by_side.py", *map(str, args), "--prefill", "agnostic", "--plot",
                    tmp_path / "p.png"], check=True)  # fmt: skip
    text = (tmp_path / "s.md").read_text()
    assert "### 25.0% of the prompt kept, 2 task(s); Full 0.750" in text
    assert "| h2o-kv kvzipwindow | 0.700 | 93% | 0.0 | 5 |" in text and "| h2o-kv tova | 0.500 | 67% |" in text
    assert "| kvpress kvzip | 0.750 | 100% |" in text and "| kvpress keydiff | 0.500 | 67% |" in text
    assert ("h2o-kv's best: **kvzipwindow 0.700**, 93% of Full's mean (meets 90 %); at or above kvpress's best "
            "press at or below its bytes (keydiff 0.500); below its best press at this fraction whatever the bytes "
            "(kvzip 0.750, 0.0 MiB)") in text  # fmt: skip
    assert "### 10.0% of the prompt kept, 2 task(s)" in text and "h2o-kv h2o |" not in text.split("### qa_1")[0]
    assert "**kvzipwindow 0.300**, 40% of Full's mean (misses 90 %); at or above" in text
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # strictly no more bytes: kvzip (0.75, Full's 400 bytes) against h2o-kv's best in 400 (kvzipwindow 0.700)
    assert "| 25.0% | kvzip 0.750, 0.0 MiB | kvzipwindow at 25.0% kept: 0.700, 0.0 MiB | **below** |" in text


def test_strict_bytes_compares_each_press_with_h2o_kvs_best_at_any_fraction_in_no_more_bytes():
    """The bar read strictly: a press against h2o-kv's best policy at any fraction whose bytes are at most the
    press's; the press h2o-kv does worst against is shown, and a press smaller than every h2o-kv row says so."""
    sys.path.insert(0, str(COMPARE))
    try:
        from side_by_side import strict_bytes
    finally:
        sys.path.remove(str(COMPARE))
    boards = {  # fraction: {(side, method): (mean, bytes, samples)}
        0.5: {("h2o-kv", "snapkv"): (0.8, 50.0, 5), ("kvpress", "kvzip"): (0.9, 100.0, 5),
              ("kvpress", "tova"): (0.6, 49.0, 5)},
        0.25: {("h2o-kv", "snapkv"): (0.6, 26.0, 5), ("kvpress", "tova"): (0.5, 25.0, 5),
               ("kvpress", "keydiff"): (0.7, 25.0, 5)},
    }  # fmt: skip
    text = "\n".join(strict_bytes(boards))
    # at 50 %: kvzip (0.9 in 100) leads h2o-kv's best in 100 bytes (snapkv at 50 %, 0.8); tova (0.6 in 49) is
    # smaller than every h2o-kv row but 26 bytes: h2o-kv's 25 % row (0.6) ties it, and kvzip's lead is the larger
    assert "| 50.0% | kvzip 0.900, 0.0 MiB | snapkv at 50.0% kept: 0.800, 0.0 MiB | **below** |" in text
    # at 25 %: both presses (25 bytes) are smaller than h2o-kv's smallest row (26): not comparable, the best named
    assert "| 25.0% | keydiff 0.700, 0.0 MiB | none holds so few (its fewest: snapkv at 25.0% kept" in text
    boards[0.5][("kvpress", "kvzip")] = (0.7, 100.0, 5)
    assert "| 50.0% | tova 0.600, 0.0 MiB | snapkv at 25.0% kept: 0.600, 0.0 MiB | at or above |" in "\n".join(
        strict_bytes(boards)
    )


def test_probe_vt_replaces_the_named_fields_of_the_policy_the_study_builds():
    """`probe_vt.py`'s `POLICY:FIELD=N` configs: the study's policy and budget with only those fields changed; a
    plain name is the study's cache; a field the policy lacks is an error, not ignored."""
    sys.path.insert(0, str(COMPARE))
    try:
        from probe_vt import config_cache
    finally:
        sys.path.remove(str(COMPARE))
    study = config_cache("snapkv", 0.25, 400, headroom=7)
    assert (study.policy.window, study.policy.pool, study.policy.budget) == (32, 31, 100)
    probe = config_cache("snapkv:window=64:pool=5", 0.25, 400, headroom=7)
    assert (probe.policy.window, probe.policy.pool, probe.policy.budget) == (64, 5, 100)
    assert config_cache("keydiff:recent=0", 0.125, 400).policy.recent == 0
    assert config_cache("keydiff", 0.125, 400).policy.recent == 8
    with pytest.raises(TypeError):
        config_cache("keydiff:pool=5", 0.25, 400)

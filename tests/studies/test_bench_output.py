"""The bench's command line and what it reports: flags, the bars (PASS, FAIL, SKIP), the results it writes and the
folder a run writes them into."""

from __future__ import annotations

import argparse
import csv
import json
import statistics

import pytest
import torch

from h2o_kv.studies import bench

from bench_helpers import GEN, CharTokenizer, sweep
from conftest import make_model

pytestmark = pytest.mark.xdist_group("bench")  # one process runs the bench once for both files (conftest)


def test_bars_are_reported(bench_run):
    """Read at the shape they are defined at (here the run's own largest), every bar passes or fails."""
    _, rows = bench_run
    first = sweep(rows)[0]["threads"]  # the bars read the first thread count's largest prompt and batch
    measured = [r for r in sweep(rows) if r["threads"] == first]
    size = max(r["prompt_len"] for r in measured), max(r["batch"] for r in measured)
    bars = {b["bar"]: b for b in bench.check_bars(rows, defined_at=size)}
    assert len(bars) == 8 and all(b["passed"] is not None for b in bars.values())
    assert bars["KV bytes H2O = budget share of full-sdpa"]["passed"]  # the accounting holds on any machine
    static = [b for b in bars.values() if "static-sdpa" in b["bar"]]
    assert len(static) == 3  # decode, prefill and same memory against StaticCache
    h2o = next(r for r in measured if (r["policy"], r["prompt_len"], r["batch"]) == ("h2o", *size))
    floor = bars["H2O decode step within 1.5x of the bandwidth floor"]["detail"]
    assert f"last step {h2o['step_ms_last']:.1f} ms" in floor  # the bar's step, with the run's median beside it
    assert f"the median step {statistics.median(h2o['step_ms']):.1f} ms" in floor
    assert f"({h2o['bandwidth_gb_s']:.1f} GB/s, the median read in turn)" in floor
    assert h2o["bandwidth_best_gb_s"] >= h2o["bandwidth_gb_s"] and "against the best read" in floor


def test_bars_defined_at_another_shape_skip_and_say_why(bench_run):
    """The speed bars are defined at 4096 x 4: a smaller run SKIPs them, naming both shapes, and still checks the
    KV accounting, which holds at any shape."""
    _, rows = bench_run
    bars = bench.check_bars(rows)
    kv = [b for b in bars if b["bar"].startswith("KV bytes")]
    assert len(kv) == 1 and kv[0]["passed"] is True
    skipped = [b for b in bars if b not in kv]
    assert skipped and all(b["passed"] is None for b in skipped)
    assert all("defined at prompt 4096 x batch 4; this run's largest is" in b["detail"] for b in skipped)
    assert all("(--size large runs it)" in b["detail"] for b in skipped)
    lines = bench.format_bars(bars).splitlines()  # the reason once, not once per bar
    assert [line for line in lines if line.startswith("SKIP")] == [
        f"SKIP  {len(skipped)} performance bars: {skipped[0]['detail']}"
    ]
    assert len(lines) == 2 and lines[1].startswith("PASS  KV bytes")


def test_write_results(bench_run, tmp_path):
    _, rows = bench_run
    paths = bench.write_results(rows, tmp_path)
    for name in ("plot_decode", "plot_steps", "plot_kv", "plot_same_memory"):
        assert paths[name].suffix == ".png" and paths[name].stat().st_size > 0
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == bench.SWEEP_COLUMNS and len(table) == len(sweep(rows))
    with paths["steps_csv"].open() as f:
        assert len(list(csv.DictReader(f))) == len(sweep(rows)) * GEN
    with paths["same_memory_csv"].open() as f:
        assert list(list(csv.DictReader(f))[0]) == bench.SAME_MEMORY_COLUMNS
    report = json.loads(paths["json"].read_text())
    assert len(report["sweep"]) == len(sweep(rows)) and len(report["bars"]) == 8
    assert report["environment"]["torch_threads"] >= 1 and report["command"]
    assert paths["bars"].read_text() == bench.format_bars(report["bars"]) + "\n"


def test_cli_flags_override_the_preset():
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    argv = ["bench", "--size", "large", "--prompt-lens", "64,128", "--policies", "h2o,local", "--threads", "0,1"]
    args = parser.parse_args(argv)
    assert args.func is bench.main
    assert args.prompt_lens == [64, 128] and args.policies == ["h2o", "local"] and args.gen_len is None
    assert args.threads == [0, 1] and args.budget == 0.2 and args.dtype is None


def test_budget_flag_means_tokens_or_a_fraction():
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    for flag, tokens in (("1", 1), ("64", 64), ("1.0", 1000), ("0.2", 200), ("20%", 200)):
        args = parser.parse_args(["bench", "--budget", flag, "--dtype", "bfloat16"])
        assert bench.policy_for("h2o", args.budget, 1000).capacity(torch.tensor([1000])).item() == tokens
    for bad in ("0", "1.5", "inf", "nan", "-3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--budget", bad])


TINY_RUN = ["--prompt-lens", "40", "--gen-len", "2", "--batch-sizes", "1", "--threads", "1", "--repeats", "1",
            "--budget", "8", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize("check", [False, True], ids=["report", "check"])
def test_a_failed_bar_fails_the_run_only_with_check(check, monkeypatch, tmp_path, capsys):
    """`h2o-kv bench --check` exits 1 when a bar FAILs (the bars' lines say which); without it the run reports and
    exits 0. The run is real, on a tiny model; one bar's reading is replaced by a failure."""
    from h2o_kv import cli
    from h2o_kv.runtime import models
    from h2o_kv.studies.bench import bars

    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (make_model("llama"), CharTokenizer()))
    real = bars.check_bars
    monkeypatch.setattr(bars, "check_bars", lambda rows: [*real(rows), dict(bar="a bar", passed=False, detail="x")])
    argv = ["bench", *TINY_RUN, "--policies", "full-sdpa,static-sdpa,h2o", "--out", str(tmp_path)]
    assert cli.main(argv + (["--check"] if check else [])) == (1 if check else 0)
    captured = capsys.readouterr()
    assert "FAIL  a bar: x" in captured.out and "SKIP  7 performance bars: defined at prompt 4096" in captured.out
    assert ("1 bar(s) failed: a bar" in captured.err) == check


@pytest.mark.parametrize("run", [["--policies", "full-sdpa,h2o"], ["--soak", "20", "--soak-every", "10", "--policies",
                                 "h2o"]], ids=["sweep", "soak"])  # fmt: skip
def test_without_out_a_run_writes_a_new_folder_never_results(run, monkeypatch, tmp_path, capsys):
    """`h2o-kv bench` without --out writes into a new bench-runs/SIZE-TIME folder of the working directory (soak:
    bench-runs/soak-TIME), never the committed results/ (results/soak, ...); a folder already there is not
    reused. The runs are real, on a tiny model."""
    from h2o_kv import cli
    from h2o_kv.runtime import models
    from h2o_kv.studies.bench import cli as bench_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (make_model("llama"), CharTokenizer()))
    monkeypatch.setattr(bench_cli.time, "strftime", lambda fmt: "20260101-120000")
    kind = "soak" if "--soak" in run else "small"
    (tmp_path / "bench-runs" / f"{kind}-20260101-120000").mkdir(parents=True)  # an earlier run in the same second
    assert cli.main(["bench", *TINY_RUN, *run]) in (0, 1)  # a 20-step soak may not be flat yet: exit 1
    captured = capsys.readouterr()
    assert f"to bench-runs/{kind}-20260101-120000-2" in captured.out + captured.err
    written = {p.name for p in (tmp_path / "bench-runs" / f"{kind}-20260101-120000-2").iterdir()}
    assert ("soak.json" if kind == "soak" else "bars.txt") in written
    assert not list((tmp_path / "bench-runs" / f"{kind}-20260101-120000").iterdir())
    assert not (tmp_path / "results").exists()

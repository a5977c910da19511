"""`report.commit` and `report.provenance`, what every figure records: the commit ("+dirty" only for changes outside
results/), and on every GPU row torch, triton and the GPU."""

from __future__ import annotations

import subprocess

from h2o_kv.studies.report import commit


def test_commit_is_dirty_for_code_changes_not_for_results(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "table.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    monkeypatch.chdir(tmp_path)
    clean = commit()
    assert clean and "+" not in clean and clean != "unknown"
    (tmp_path / "results" / "table.json").write_text('{"rows": 1}')  # a study writing its results meanwhile
    (tmp_path / "results" / "new.csv").write_text("a\n")
    assert commit() == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit() == clean + "+dirty"


def test_every_gpu_row_records_where_it_ran(tmp_path):
    """The GPU study's rows (bench/gpu.py `logger`) carry `report.provenance`: the commit, torch, triton, the GPU
    (None on a CPU); a row's own keys win."""
    import json

    import torch

    from h2o_kv.studies.bench.gpu import logger

    rows, log = logger(tmp_path, torch.device("cpu"))
    log(dict(cell="step", ms=1.0, gpu="given"))
    (written,) = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert written == rows[0]
    assert written["cell"] == "step" and written["gpu"] == "given" and written["torch"] == torch.__version__
    assert written["commit"] and "triton" in written


def test_a_recorded_command_shows_paths_inside_a_checkout_from_its_root(tmp_path):
    """A study run from a worktree writes to the main checkout by absolute path; the command its summary records
    reads as from the checkout's root, whichever clone ran it. Paths outside a checkout stay as given."""
    from h2o_kv.studies.report import command_line

    (tmp_path / "clone" / ".git").mkdir(parents=True)
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / ".git").write_text("gitdir: elsewhere\n")  # a worktree's .git is a file
    argv = ["/venv/bin/h2o-kv", "eval", "--out", f"{tmp_path}/clone/results/t", "--samples", f"{tmp_path}/tree/s.jsonl",
            "--model", f"{tmp_path}/models/m", "--threads", "1"]  # fmt: skip
    assert (
        command_line(argv) == f"h2o-kv eval --out results/t --samples s.jsonl --model {tmp_path}/models/m --threads 1"
    )

"""`report.commit`, the provenance every figure records: the commit, "+dirty" only for changes outside results/."""

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

"""Finished cells of an evaluation on disk, so a study that runs for hours resumes where it stopped.

A cell is one policy at one budget on one task setting (perplexity: the windows; retrieval: one context
length and prefill). With an output directory every finished cell is written to `<out>/cells/` as one
JSON file holding its rows and the key that names it: the task's settings, the model and its dtype, the
mode, seed and corpus, the torch and transformers versions and a digest of the h2o-kv source that computes the
numbers (`source_digest`). `h2o-kv
eval --resume` (`run_eval(resume=True)`) takes a cell from there when its key matches exactly and runs
the others, so an interrupted run picks up where it stopped and a changed setting or changed code never
reuses a stale result. Without `--resume` every cell runs (and is written, for a later `--resume`).

Each cell is also appended, as one line, to `<out>/cells.jsonl`, which `--resume` reads for the cells the folder
lacks: the folder is git-ignored (hundreds of files), the one file can be committed, so a run of many sessions
resumes from a fresh clone (check it out at the commit the run started from: the source digest is in each key).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

# h2o-kv's code that cannot change an eval's numbers: serving, the cluster, the throughput studies, the CLI
NOT_NUMERICS = ("runtime/serve/", "runtime/cluster/", "studies/bench/", "studies/loadgen.py",
                "studies/serve_results.py", "cli.py", "lazy.py")  # fmt: skip


@cache
def source_digest() -> str:
    """A digest of the h2o_kv source that computes an eval's numbers (Python and the C++ kernels): a change there
    gives another key; a change to serving, the CLI or the throughput studies does not."""
    root = Path(__file__).resolve().parent.parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for ext in ("*.py", "*.cpp", "*.h") for p in root.rglob(ext)):
        name = path.relative_to(root).as_posix()
        if not name.startswith(NOT_NUMERICS):
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class Cells:
    """Cells under `root` (None: nothing stored), keyed by `identity` plus each cell's own name."""

    def __init__(self, root: Path | None, identity: dict[str, Any], *, resume: bool = False) -> None:
        self.root, self.identity, self.resume = root, identity, resume
        self.ran = self.reused = 0
        self.bundle = None if root is None else root.with_suffix(".jsonl")  # <out>/cells.jsonl: every cell, a line each
        self._bundled: dict[str, list[dict]] | None = None
        self._tidied = False  # an unfinished last line of cells.jsonl cut off (before this store's first append)

    def _from_bundle(self, key: str) -> list[dict] | None:
        """The rows `cells.jsonl` holds under `key` (read once). An interrupted append leaves a last line without its
        newline: that line is no cell, and is left out; any other unreadable line is an error."""
        if self._bundled is None:
            self._bundled = {}
            text = self.bundle.read_text() if self.bundle.is_file() else ""
            for number, line in enumerate(text.split("\n")[:-1], 1):  # the last piece: "" or an interrupted line
                if line.strip():
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{self.bundle} line {number} is unreadable ({err})") from None
                    self._bundled[entry["key"]] = entry["rows"]
        return self._bundled.get(key)

    def _path(self, name: dict[str, Any]) -> tuple[str, Path]:
        assert self.root is not None
        key = json.dumps({**self.identity, **name}, sort_keys=True, default=str)
        return key, self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    def stored(self, name: dict[str, Any]) -> list[dict] | None:
        """The cell's stored rows when resuming and its key matches exactly, else None."""
        if self.root is None or not self.resume:
            return None
        key, path = self._path(name)
        if not path.is_file():
            rows = self._from_bundle(key)
            self.reused += rows is not None
            return rows
        try:
            stored = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"stored eval cell {path} is unreadable ({err}); delete it and run again") from None
        if stored.get("key") != key:
            return None
        self.reused += 1
        return stored["rows"]

    def put(self, name: dict[str, Any], rows: list[dict]) -> None:
        """Store a computed cell (nothing without a root)."""
        self.ran += 1
        if self.root is None:
            return
        key, path = self._path(name)
        self.root.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        line = json.dumps({"key": key, "rows": rows})
        partial.write_text(line)
        os.replace(partial, path)  # whole or absent: an interrupted write leaves no half cell
        self._append(line)

    def _append(self, line: str) -> None:
        """Append a cell's line to `cells.jsonl`, after cutting off a line an interrupted append left unfinished (the
        first time this store appends: only another process can have left one)."""
        if not self._tidied and self.bundle.is_file():
            data = self.bundle.read_bytes()
            if data and not data.endswith(b"\n"):
                with open(self.bundle, "r+b") as bundle:
                    bundle.truncate(data.rfind(b"\n") + 1)
        self._tidied = True
        with open(self.bundle, "a") as bundle:  # one write of the whole line
            bundle.write(line + "\n")

    def get(self, name: dict[str, Any], compute: Callable[[], list[dict]], progress: Any = None) -> list[dict]:
        """The cell's rows: stored ones when resuming and the key matches, else `compute()` (then stored).
        `progress` (a tqdm bar) advances by one for a reused cell, as `compute` advances it for a run one."""
        rows = self.stored(name)
        if rows is not None:
            if progress is not None:
                progress.update(1)
            return rows
        rows = compute()
        self.put(name, rows)
        return rows

"""Interim counts of a running `h2o-kv eval` from its cells (OUT/cells.jsonl): per (policy, fraction) and task, the
scores summed over every answered question and the questions asked, for docs while a long run goes on; a RULER
run's two settings (query-aware, query-agnostic) apart.

    python compare/interim_counts.py results/compress-once/qwen2.5-coder-0.5b/cells.jsonl [--code DIGEST]

`--code` keeps the cells of one source digest (a run's cells all share one; an earlier run's may be in the file).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def counts(path: Path, code: str | None = None) -> tuple[dict, set]:
    """{(setting, policy, budget): {subtask: [score sum, questions]}} and the (setting, subtask, seed) samples seen,
    from the cells in `path` (setting: "" for a run with one way of asking)."""
    table: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    samples = set()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        cell = json.loads(line)
        key = json.loads(cell["key"])
        if code is not None and key.get("code") != code:
            continue
        setting = key.get("setting") or ""
        samples.add((setting, key["subtask"], key["sample_seed"]))
        total = table[(setting, key["policy"], key["budget"])][key["subtask"]]
        for row in cell["rows"]:
            total[0] += row["score"]
            total[1] += 1
    return table, samples


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", type=Path)
    parser.add_argument("--code", help="only the cells of this source digest")
    args = parser.parse_args(argv)
    table, samples = counts(args.cells, args.code)
    tasks = sorted({task for by_task in table.values() for task in by_task})
    print(f"{len(samples)} samples; score sum / questions")
    print("| setting | policy | fraction | " + " | ".join(tasks) + " | mean score |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in tasks) + " | --- |")
    order = lambda item: (item[0][0], item[0][2] or 1, item[0][1])  # noqa: E731
    for (setting, policy, budget), by_task in sorted(table.items(), key=order):
        cells = [by_task.get(task) for task in tasks]
        shown = [f"{c[0]:g} / {c[1]}" if c else "" for c in cells]
        means = [c[0] / c[1] for c in cells if c and c[1]]
        mean = sum(means) / len(means) if means else float("nan")
        fraction = budget if budget is not None else "full"
        print(f"| {setting} | {policy} | {fraction} | " + " | ".join(shown) + f" | {mean:.3f} |")


if __name__ == "__main__":
    main()

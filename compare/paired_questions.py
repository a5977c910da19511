"""Question by question: one h2o-kv policy against one kvpress press on the same contexts and questions.

    python compare/paired_questions.py --model qwen2.5-coder-1.5b --policy keydiff --press keydiff

Reads h2o-kv's cells (results/compress-once/MODEL/cells.jsonl: one row per question) and kvpress's results
(results/kvpress-compress-once-MODEL/results.json: a score per question), pairs them by the exported sample
(compare/kvpress/samples-compress-once-MODEL.jsonl: its seed is h2o-kv's `sample_seed`), and counts, per kept
fraction and per task, the questions both score alike and those one of them gets more of. Where a per-task mean
differs between two rules that rank alike, this says whether it is one question or a pattern.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIOS = {0.25: 0.75, 0.1: 0.9}  # h2o-kv's kept fraction: kvpress's compression ratio


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--policy", default="keydiff", help="h2o-kv's policy name in the cells")
    parser.add_argument("--press", default="keydiff", help="kvpress's press name in its results")
    args = parser.parse_args(argv)
    samples = ROOT / f"compare/kvpress/samples-compress-once-{args.model}.jsonl"
    ids = {json.loads(line)["seed"]: json.loads(line)["id"] for line in samples.open()}
    mine: dict[tuple[str, float], list[float]] = {}
    for line in (ROOT / f"results/compress-once/{args.model}/cells.jsonl").open():
        cell = json.loads(line)
        key = json.loads(cell["key"])
        if key.get("kind", "").startswith("retrieval") and key["policy"] == args.policy:
            if key["sample_seed"] in ids:
                mine[(ids[key["sample_seed"]], key["budget"])] = [row["score"] for row in cell["rows"]]
    theirs = json.loads((ROOT / f"results/kvpress-compress-once-{args.model}/results.json").read_text())["cells"]
    for fraction, ratio in RATIOS.items():
        total, per_task = collections.Counter(), collections.defaultdict(collections.Counter)
        for cell in theirs.values():
            if cell["press"] != args.press or cell["ratio"] != ratio:
                continue
            for sample, got in cell["samples"].items():
                if (sample, fraction) not in mine or got.get("scores") is None:
                    continue
                for a, b in zip(mine[(sample, fraction)], got["scores"]):
                    side = "same" if a == b else "h2o-kv more" if a > b else "kvpress more"
                    total[side] += 1
                    per_task[sample.rsplit("-", 2)[0]][side] += 1
        print(f"{fraction:.0%} kept: h2o-kv {args.policy} vs kvpress {args.press}, questions: {dict(total)}")
        for task, counts in sorted(per_task.items()):
            if len(counts) > 1:
                print(f"  {task}: {dict(counts)}")


if __name__ == "__main__":
    main()

"""Compare a rerun's rows with the committed results/eval/results.csv: equal, differing (largest first), missing.

.venv/bin/h2o-kv eval --tasks perplexity,fidelity --out results/eval/rerun-prompt-kernel
.venv/bin/python results/eval/rerun-prompt-kernel/compare.py results/eval/rerun-prompt-kernel/results.csv
"""

import csv
import sys

KEY = ("task", "subtask", "prefill", "policy", "budget_frac", "budget_tokens", "length", "metric", "mode", "chunk")


def rows(path: str) -> dict[tuple, float]:
    with open(path) as f:
        return {tuple(row[k] for k in KEY): float(row["value"]) for row in csv.DictReader(f)}


def main(rerun: str, committed: str = "results/eval/results.csv") -> None:
    old, new = rows(committed), rows(rerun)
    missing = [key for key in new if key not in old]
    differ = [key for key in new if key in old and new[key] != old[key]]
    changed = sorted(((abs(new[k] - old[k]) / max(abs(old[k]), 1e-12), k) for k in differ), reverse=True)
    equal = len(new) - len(changed) - len(missing)
    print(f"{len(new)} rows: {equal} equal, {len(changed)} differ, {len(missing)} missing")
    for rel, key in changed:
        print(f"  {rel:.2e}  {old[key]:.6g} -> {new[key]:.6g}  {dict(zip(KEY, key))}")


if __name__ == "__main__":
    main(*sys.argv[1:])

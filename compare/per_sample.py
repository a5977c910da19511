"""One h2o-kv policy and one kvpress press on the same samples, sample by sample.

    python compare/per_sample.py --h2o-cells results/qwen/h2o-kv-8k/cells --policy tova \\
        --kvpress results/qwen/kvpress-8k/results.json --press tova --samples compare/kvpress/samples-qwen-8k.jsonl

    python compare/per_sample.py --h2o-cells results/ruler/qwen2.5-coder-0.5b/cells.jsonl --setting agnostic \
        --policy best --kvpress results/ruler/kvpress-qwen2.5-coder-0.5b-query-agnostic/results.json --press best \
        --samples compare/kvpress/samples-ruler4k-qwen2.5-coder-0.5b.jsonl

side_by_side.py compares means; this says whether two methods answer the same samples right, which is what a
claim like "kvpress's TOVA ranked per KV head is h2o-kv's TOVA" needs. `best` on either side: per sample, the best
score of any bounded policy (or any press, whatever its bytes). `--setting`: RULER's cells of one setting (aware or
agnostic). It reads h2o-kv's stored eval cells (one file per sample, policy and budget under `OUT/cells/`, written
by `h2o-kv eval --out OUT`, or the same records in the `OUT/cells.jsonl` a long run commits), run_kvpress.py's
results.json (per-sample scores) and the samples file it ran, pairs the samples by task, context and seed, and
prints, per budget, how many pairs score the same (and how many h2o-kv scores at least as well) and which differ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from side_by_side import kept_fraction, model_of  # compare/ is on the path when run as a script


def h2o_scores(
    cells: Path, policy: str, setting: str | None = None
) -> tuple[dict[tuple[float, str, int, int], float], set[str]]:
    """{(fraction kept, task, context, sample seed): score} for one policy ("best": the best bounded one per sample)
    from h2o-kv's cell files (one-question retrieval; `setting`: only RULER's cells of it), and the models the cells
    ran (the model folder's name). Raises ValueError where two cells score the same sample, policy and budget: a
    folder that also holds an earlier run's cells (another source digest, mode or version), whose scores would
    otherwise be taken in file order."""
    models, seen = set(), {}  # seen: {(policy, pair): (the cell's key, its score)}
    if cells.is_dir():
        records = [json.loads(path.read_text()) for path in sorted(cells.glob("*.json"))]
    else:  # the committed cells.jsonl: one cell a line
        records = [json.loads(line) for line in cells.read_text().splitlines() if line.strip()]
    for stored in records:
        key = json.loads(stored["key"])
        if key.get("kind") != "retrieval-sample" or key.get("budget") is None:
            continue
        if key.get("policy") != policy and not (policy == "best" and key.get("policy") != "full"):
            continue
        if setting is not None and key.get("setting") != setting:
            continue
        (row,) = stored["rows"]  # one sample per cell
        models.add(Path(key["model"]).name)
        pair = (round(key["budget"], 6), key["subtask"], key["context"], key["sample_seed"])
        if (key["policy"], pair) in seen:
            other = seen[key["policy"], pair][0]
            differ = sorted(k for k in key.keys() | other.keys() if key.get(k) != other.get(k))
            raise ValueError(f"two cells of {key['policy']} for one sample ({key['subtask']}, {key['context']} tokens, "
                             f"seed {key['sample_seed']}, {pair[0]:.0%}) that differ in {', '.join(differ)}: the "
                             "folder holds more than one run; give one run's cells (or a --setting)")  # fmt: skip
        seen[key["policy"], pair] = key, row["score"]
    best: dict[tuple[float, str, int, int], float] = {}
    for (_, pair), (_, score) in seen.items():
        best[pair] = max(score, best.get(pair, score))
    return best, models


def kvpress_scores(results: Path, press: str, samples: dict[str, dict]) -> dict[tuple[float, str, int, int], float]:
    """The same keys from run_kvpress.py's results.json ("best": any press's best per sample); `samples` maps its
    sample ids to their records."""
    out = {}
    for cell in json.loads(results.read_text())["cells"].values():
        if (press != "best" and cell["press"] != press) or cell["ratio"] is None:  # Full: no ratio
            continue
        fraction = kept_fraction(cell["ratio"])
        for sid, result in cell["samples"].items():
            rec = samples[sid]
            key = (fraction, rec["task"], rec["context_tokens"], rec["seed"])
            out[key] = max(result["score"], out.get(key, result["score"]))
    return out


def compare(ours: dict, theirs: dict, ids: dict[tuple[str, int, int], str]) -> list[str]:
    """Per budget: pairs that score the same out of the samples both ran (and those where h2o-kv scores at least as
    well), then the pairs that differ (by the sample's id in the samples file; `ids` maps (task, context, seed) to
    it)."""
    lines = []
    for fraction in sorted({k[0] for k in theirs}):
        both = sorted(k for k in theirs if k[0] == fraction and k in ours)
        differ = [k for k in both if ours[k] != theirs[k]]
        above = sum(ours[k] >= theirs[k] for k in both)
        lines.append(f"{fraction:.0%} kept: {len(both) - len(differ)} of {len(both)} samples score the same, h2o-kv "
                     f"at or above in {above}")  # fmt: skip
        lines += [f"  {ids[k[1:]]}: h2o-kv {ours[k]:.2f}, kvpress {theirs[k]:.2f}" for k in differ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--h2o-cells", required=True, type=Path,
                        help="h2o-kv eval's OUT/cells folder, or the OUT/cells.jsonl committed beside it")  # fmt: skip
    parser.add_argument("--policy", required=True, help="the h2o-kv policy (h2o, snapkv, adakv, tova, ...; best)")
    parser.add_argument("--setting", choices=("aware", "agnostic"), help="RULER's cells of one setting")
    parser.add_argument("--kvpress", required=True, type=Path, help="run_kvpress.py's results.json")
    parser.add_argument("--press", required=True, help="the kvpress press as run_kvpress.py names it (best)")
    parser.add_argument("--samples", required=True, type=Path, help="the samples file kvpress ran (export_samples.py)")
    args = parser.parse_args()
    if not args.h2o_cells.exists():
        parser.error(f"{args.h2o_cells} does not exist (rerun the eval command with --resume to write its cells)")
    records = [json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()]
    try:
        ours, models = h2o_scores(args.h2o_cells, args.policy, args.setting)
    except ValueError as err:
        parser.error(str(err))
    theirs_model = model_of(str(args.kvpress))
    if models - {theirs_model}:
        parser.error(f"the cells ran {', '.join(sorted(models))}, kvpress ran {theirs_model}")
    theirs = kvpress_scores(args.kvpress, args.press, {r["id"]: r for r in records})
    if not ours or not theirs:
        parser.error(f"nothing to pair: {len(ours)} cells of {args.policy}, {len(theirs)} scores of {args.press}")
    ids = {(r["task"], r["context_tokens"], r["seed"]): r["id"] for r in records}
    print("\n".join(compare(ours, theirs, ids)))


if __name__ == "__main__":
    main()

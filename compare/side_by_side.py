"""h2o-kv's retrieval study and kvpress's run on the same samples, in one table per (task, context) and budget.

    python compare/side_by_side.py --h2o results/qwen/h2o-kv-4k20/results.json \\
        --kvpress results/qwen/kvpress-4k20/results.json --out /tmp/side_by_side.md
    python compare/side_by_side.py --prefill agnostic --out results/compress-once/side_by_side.md \\
        --h2o results/compress-once/qwen2.5-coder-0.5b/results.json \\
        --kvpress results/kvpress-compress-once-qwen2.5-coder-0.5b/results.json

Reads h2o-kv's `h2o-kv eval` results (the retrieval rows of one prefill setting, `--prefill`: oneshot by default,
agnostic for the compress-once study; score and KV bytes kept after the prompt, per policy and budget) and
run_kvpress.py's per-sample cache (score and the bytes of its cache's key and value tensors after the prefill). For
each cell it names h2o-kv's best policy, kvpress's best press at or below that policy's KV bytes, and checks issue
40's bars: h2o-kv's best >= 90 % of Full's score, and >= the best such press. First the same at the level of the
mean over the tasks per kept fraction (the leaderboard's view, issues 50 and 52), and with `--plot` its picture.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def kept_fraction(ratio: float) -> float:
    """The fraction of the prompt a kvpress press keeps at compression `ratio` (the share it removes)."""
    return round(1.0 - ratio, 6)


def h2o_cells(path: str, prefill: str = "oneshot") -> dict[tuple[str, int, float], dict[str, tuple]]:
    """{(task, context, fraction): {policy: (score, kv bytes, samples)}} from h2o-kv's results.json (Full at 1.0), the
    rows of one prefill setting."""
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r["task"] == "retrieval"]
    rows = [r for r in rows if r["prefill"] == prefill]
    cells: dict = {}
    for r in rows:
        key = (r["subtask"], r["length"], round(r["budget_frac"], 6))
        entry = cells.setdefault(key, {}).setdefault(r["policy"], [None, None, r["n"]])
        entry[0 if r["metric"] == "score" else 1 if r["metric"] == "kv_bytes" else 2] = r["value"]
    cells = {k: {p: tuple(v) for p, v in d.items()} for k, d in cells.items()}
    for (task, context, fraction), policies in cells.items():  # each fraction's Full from the same file: merged
        full = cells.get((task, context, 1.0), {}).get("full")  # with another run, its Full stays with its cells
        if fraction < 1.0 and full is not None:
            policies["full"] = full
    return cells


def kvpress_cells(path: str, first: dict | None = None) -> dict[tuple[str, int, float], dict[str, tuple]]:
    """The same shape from run_kvpress.py's results.json (Full at fraction 1.0). `first`: {(task, context, fraction):
    n}, a cell's samples cut to its first n (export_samples numbers them TASK-CONTEXT-NN; a smaller set is a prefix of
    a larger one), so each mean is over the samples the other library's cell ran."""
    cells: dict = {}
    for c in json.loads(Path(path).read_text())["cells"].values():
        fraction = 1.0 if c["ratio"] is None else kept_fraction(c["ratio"])
        n = None if first is None else first.get((c["task"], c["context"], fraction))
        samples = [v for k, v in c["samples"].items() if n is None or _index(k, path) < n]
        if not samples:
            continue
        score = sum(s["score"] for s in samples) / len(samples)
        kv_bytes = sum(s["kv_bytes"] for s in samples) / len(samples)
        cells.setdefault((c["task"], c["context"], fraction), {})[c["press"]] = (score, kv_bytes, len(samples))
    return cells


def _index(sample: str, path: str) -> int:
    """A sample's number in its task (export_samples' ids: TASK-CONTEXT-NN)."""
    number = sample.rsplit("-", 1)[-1]
    if not number.isdigit():
        raise SystemExit(f"side_by_side.py: {path}: sample {sample!r} is not numbered (TASK-CONTEXT-NN): "
                         "--match-samples cannot cut it")  # fmt: skip
    return int(number)


def model_of(path: str) -> str | None:
    """The model a results.json ran (the folder's name: h2o-kv records `model`, run_kvpress.py `model_dir`)."""
    meta = json.loads(Path(path).read_text()).get("meta", {})
    where = meta.get("model") or meta.get("model_dir")
    return None if where is None else Path(where).name


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def table(task: str, context: int, fraction: float, ours: dict, theirs: dict, full: float | None) -> list[str]:
    lines = [f"### {task}, {context} tokens, {fraction:.0%} of the prompt", "",
             "| method | score | KV MiB | samples |", "| --- | --- | --- | --- |"]  # fmt: skip
    for side, cells in (("h2o-kv", ours), ("kvpress", theirs)):
        for name, (score, kv_bytes, n) in sorted(cells.items(), key=lambda item: -item[1][0]):
            lines.append(f"| {side} {name} | {score:.2f} | {_mib(kv_bytes)} | {n} |")
    best, (score, kv_bytes, n) = max(ours.items(), key=lambda item: (item[1][0], -(item[1][1] or 0)))
    fits = {name: v for name, v in theirs.items() if kv_bytes is not None and v[1] <= kv_bytes * 1.001}
    verdicts = []
    if full:
        meets = "meets" if score >= 0.9 * full else "misses"
        verdicts.append(f"{score / full:.0%} of Full's {full:.2f} ({meets} 90 %)")
    if fits:
        press, (press_score, press_bytes, press_n) = max(fits.items(), key=lambda item: item[1][0])
        verdict = "at or above" if score >= press_score else "below"
        counts = "" if press_n == n else f"; {press_n} samples to h2o-kv's {n}"
        verdicts.append(f"{verdict} kvpress's best press at or below its bytes ({press} {press_score:.2f}, "
                        f"{press_bytes / 2**20:.1f} MiB{counts})")  # fmt: skip
    else:
        verdicts.append("no kvpress press at or below its bytes" if kv_bytes is not None else "bytes not measured")
    summary = f"h2o-kv's best: **{best} {score:.2f}**, {_mib(kv_bytes)} MiB: " + "; ".join(verdicts)
    return lines + ["", summary, ""]


def averages(ours: dict, theirs: dict) -> tuple[list[str], dict]:
    """The leaderboard's view: per kept fraction, each method's mean score over the tasks every shown method ran
    (and its mean KV bytes), Full's mean over the same tasks, and the bars at that level (h2o-kv's best policy >= 90 %
    of Full's mean; >= kvpress's best press at or below its bytes). Returns the lines and {method: {fraction: mean}}
    for the plot."""
    lines = ["## Mean over the tasks, per kept fraction", ""]
    curves: dict[str, dict[float, float]] = {}
    boards: dict[float, dict] = {}  # fraction: {(side, method): (mean, bytes, fewest samples)}, for `strict_bytes`
    for fraction in sorted({k[2] for k in ours if k[2] < 1.0}, reverse=True):
        keys = [k for k in ours if k[2] == fraction]
        methods = {("h2o-kv", p): [ours[k].get(p) for k in keys] for k in keys for p in ours[k] if p != "full"}
        methods |= {("kvpress", p): [theirs.get(k, {}).get(p) for k in keys] for k in keys for p in theirs.get(k, {})}
        methods = {m: v for m, v in methods.items() if all(x is not None for x in v)}  # every task ran
        fulls = [ours[k].get("full") for k in keys]  # the Full of the run these cells came from
        if not methods or any(f is None for f in fulls):
            continue
        full = sum(f[0] for f in fulls) / len(fulls)
        rows = {m: (sum(x[0] for x in v) / len(v), _mean_bytes(v), min(x[2] for x in v)) for m, v in methods.items()}
        boards[fraction] = rows
        lines += [f"### {fraction:.1%} of the prompt kept, {len(keys)} task(s); Full {full:.3f}", "",
                  "| method | mean score | of Full | KV MiB | samples per task (fewest) |",
                  "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for (side, name), (score, kv_bytes, n) in sorted(rows.items(), key=lambda item: -item[1][0]):
            lines.append(f"| {side} {name} | {score:.3f} | {score / full:.0%} | {_mib(kv_bytes)} | {n} |")
            curves.setdefault(f"{side} {name}", {})[fraction] = score
        mine = {m: v for m, v in rows.items() if m[0] == "h2o-kv"}
        if mine:
            (_, best), (score, kv_bytes, _) = max(mine.items(), key=lambda item: (item[1][0], -(item[1][1] or 0)))
            fits = {m: v for m, v in rows.items() if m[0] == "kvpress" and kv_bytes and v[1] <= kv_bytes * 1.001}
            verdict = f"h2o-kv's best: **{best} {score:.3f}**, {score / full:.0%} of Full's mean"
            verdict += " (meets 90 %)" if score >= 0.9 * full else " (misses 90 %)"
            if fits:
                (_, press), (press_score, _, _) = max(fits.items(), key=lambda item: item[1][0])
                verdict += f"; {'at or above' if score >= press_score else 'below'} kvpress's best press at or below "
                verdict += f"its bytes ({press} {press_score:.3f})"
            theirs_all = {m: v for m, v in rows.items() if m[0] == "kvpress"}
            if theirs_all and max(theirs_all.items(), key=lambda item: item[1][0])[0] not in fits:
                # a press that masks its evicted tokens (KVzip, AdaKV) keeps Full's bytes: shown apart, not the bar
                (_, press), (press_score, press_bytes, _) = max(theirs_all.items(), key=lambda item: item[1][0])
                verdict += f"; {'at or above' if score >= press_score else 'below'} its best press at this fraction "
                verdict += f"whatever the bytes ({press} {press_score:.3f}, {_mib(press_bytes)} MiB)"
            lines += ["", verdict]
        lines.append("")
        curves.setdefault("full", {})[1.0] = full
    return lines + strict_bytes(boards), curves


def strict_bytes(boards: dict[float, dict]) -> list[str]:
    """The bar read the strict way: each kvpress press against h2o-kv's best policy at ANY fraction holding no more
    bytes than the press (at the same fraction h2o-kv holds its 12 bytes a slot of bookkeeping more). Per fraction the
    press h2o-kv does worst against (the largest lead of the press), so one row says whether every press is met."""
    ours = [(f, name, v) for f, rows in boards.items() for (side, name), v in rows.items() if side == "h2o-kv"]
    ours = [row for row in ours if row[2][1] is not None]  # bytes measured
    lines = []
    for fraction, rows in sorted(boards.items(), reverse=True):
        hardest = None  # (lead of the press, press, its (mean, bytes), h2o-kv's (fraction, policy, (mean, bytes)))
        for (side, press), (score, kv_bytes, _) in rows.items():
            if side != "kvpress" or kv_bytes is None or not ours:
                continue
            fits = [row for row in ours if row[2][1] <= kv_bytes]
            mine = max(fits, key=lambda row: (row[2][0], -row[2][1]), default=None)
            lead = (mine is None, score - (mine[2][0] if mine else 0.0))  # no h2o-kv row that small: first
            if hardest is None or lead > hardest[0]:
                hardest = (lead, press, (score, kv_bytes), mine)
        if hardest is None:
            continue
        (_, lead), press, (score, kv_bytes), mine = hardest
        if mine is None:
            least = min(ours, key=lambda row: row[2][1])
            ours_text = f"none holds so few (its fewest: {least[1]} at {least[0]:.1%} kept, {_mib(least[2][1])} MiB)"
            verdict = "not comparable"
        else:
            ours_text = f"{mine[1]} at {mine[0]:.1%} kept: {mine[2][0]:.3f}, {_mib(mine[2][1])} MiB"
            verdict = "at or above" if lead <= 0 else "**below**"
        lines.append(f"| {fraction:.1%} | {press} {score:.3f}, {_mib(kv_bytes)} MiB | {ours_text} | {verdict} |")
    if not lines:
        return []
    return ["## At strictly no more bytes", "",
            "Each kvpress press against h2o-kv's best policy at any kept fraction whose KV bytes are at most the "
            "press's; per fraction, the press h2o-kv does worst against.", "",
            "| kvpress at | its hardest press | h2o-kv's best in no more bytes | h2o-kv |", "| --- | --- | --- | --- |",
            *lines, ""]  # fmt: skip


def _mean_bytes(cells: list[tuple]) -> float | None:
    known = [x[1] for x in cells if x[1] is not None]
    return sum(known) / len(known) if len(known) == len(cells) else None


SAME_METHOD = {"h2o": "observed_attention", "adakv": "adakv_snapkv"}  # h2o-kv's name: kvpress's press for it


def _method(name: str) -> str:
    """A curve's method, one colour for both libraries' versions of it ("h2o-kv snapkv" and "kvpress snapkv")."""
    base = name.split(" ", 1)[-1]
    return SAME_METHOD.get(base, base)


def plot(curves: dict[str, dict[float, float]], path: str, title: str) -> None:
    """Mean score against the fraction kept, one line per method (h2o-kv solid, kvpress dashed; one colour for a
    method both libraries have), Full as a line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    methods = sorted({_method(name) for name in curves if name != "full"})
    palette = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")  # tab10: no two methods in like shades
    colors = {m: palette(i % palette.N) for i, m in enumerate(methods)}
    for name, points in sorted(curves.items()):
        if name == "full":
            ax.axhline(points[1.0], color="black", linewidth=1, label="Full")
            continue
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", linestyle="--" if name.startswith("kvpress") else "-",
                color=colors[_method(name)], label=name)  # fmt: skip
    ax.set_xticks(sorted({x for points in curves.values() for x in points if x < 1.0}))
    ax.set_xlabel("fraction of the prompt kept")
    ax.set_ylabel("mean score over the tasks")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: no line hidden
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--h2o",
        required=True,
        nargs="+",
        help="h2o-kv eval's results.json (several: a later "
        "file's cells replace an earlier one's of the same task, context and budget)",
    )
    parser.add_argument("--kvpress", nargs="*", default=[],
                        help="run_kvpress.py's results.json (merged so too; none: h2o-kv's side alone)")  # fmt: skip
    parser.add_argument("--out", required=True, help="the markdown file to write")
    parser.add_argument("--prefill", default="oneshot", choices=("oneshot", "agnostic"),
                        help="h2o-kv's setting: the question in the prompt, or after it (compress-once)")  # fmt: skip
    parser.add_argument("--plot", help="a PNG of each method's mean score against the fraction kept")
    parser.add_argument("--match-samples", action="store_true",
                        help="each kvpress cell's mean over its first n samples, n: h2o-kv's count there")  # fmt: skip
    args = parser.parse_args()
    models = {path: model_of(path) for path in [*args.h2o, *args.kvpress]}
    if len(set(models.values()) - {None}) > 1:  # a table across models would compare nothing
        parser.error("the inputs ran different models: " + ", ".join(f"{p} {m}" for p, m in models.items()))
    model = next((m for m in models.values() if m is not None), "not recorded")
    ours, theirs = {}, {}
    for path in args.h2o:
        ours |= h2o_cells(path, args.prefill)
    first = None  # --match-samples: kvpress's cells cut to h2o-kv's sample count (Full: the largest one)
    if args.match_samples:
        first = {k: max(v[2] for v in cell.values()) for k, cell in ours.items()}
    for path in args.kvpress:
        theirs |= kvpress_cells(path, first)
    sources = ", ".join(f"`{p}`" for p in [*args.h2o, *args.kvpress])
    lines = ["# h2o-kv and kvpress on the same samples (generated by compare/side_by_side.py; do not edit)", "",
             f"Model: `{model}`. Sources: {sources}. Score: RULER string match, mean over samples. KV MiB: "
             "bytes kept after the prompt, per sample (h2o-kv: `KVCache.kept_nbytes()`, keys and values plus "
             "12 bytes of bookkeeping per slot; kvpress: its cache's key and value tensors).", ""]  # fmt: skip
    board, curves = averages(ours, theirs)
    lines += board
    if args.plot:
        plot(curves, args.plot, f"{model}, {args.prefill}: mean over the tasks")
    for task, context, fraction in sorted(k for k in ours if k[2] < 1.0):
        full = ours[(task, context, fraction)].get("full", (None,))[0]
        press = {k: v for k, v in theirs.get((task, context, fraction), {}).items()}
        mine = {k: v for k, v in ours[(task, context, fraction)].items() if k != "full"}
        lines += table(task, context, fraction, mine, press, full)
    fulls = [f"{task} {context}: h2o-kv {ours[(task, context, 1.0)]['full'][0]:.2f}, kvpress "
             f"{theirs.get((task, context, 1.0), {}).get('full', (float('nan'),))[0]:.2f}"
             for task, context, fraction in sorted(ours) if fraction == 1.0]  # fmt: skip
    lines += ["Full (no eviction): " + "; ".join(fulls), ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

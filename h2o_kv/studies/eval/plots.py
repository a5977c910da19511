"""One figure per eval task: metric versus budget, one line per policy, Full as a dashed line."""

from __future__ import annotations

from pathlib import Path

from h2o_kv.policies import is_fraction
from h2o_kv.studies.eval.ruler_spec import label
from h2o_kv.studies.eval.tables import PLOT_METRICS, mean, panels
from h2o_kv.studies.report import pyplot, save_figure

# (colour, marker, size): sizes shrink down the list so equal values stay visible on top of each other
STYLE = {
    "h2o": ("tab:red", "o", 10),
    "local": ("tab:blue", "s", 8),
    "streamingllm": ("tab:green", "^", 6),
    "tova": ("tab:purple", "D", 4),
}


def plot_task(rows: list[dict], task: str, path: Path) -> None:
    """One PNG per task: a panel per (metric, subtask/prefill); one line per policy, Full dashed."""
    plt = pyplot()
    figures = [(m, key, pol) for m in PLOT_METRICS[task] for key, pol in panels(rows, m).items()]
    if not figures:
        return
    if task == "retrieval":  # rows: prefill settings; columns: subtasks
        subtasks = list(dict.fromkeys(k[0] for _, k, _ in figures))
        prefills = list(dict.fromkeys(k[1] for _, k, _ in figures))
        nrows, ncols = len(prefills), len(subtasks)
        where = {k: (prefills.index(k[1]), subtasks.index(k[0])) for _, k, _ in figures}
    else:
        nrows, ncols = 1, len(figures)
        where = {k: (0, i) for i, (_, k, _) in enumerate(figures)}
    width = max(6.4, 4.2 * ncols)  # room for the title when there is a single panel
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.6 * nrows), squeeze=False)
    frac = all(r["budget"] is None or is_fraction(r["budget"]) for r in rows)
    for metric, key, pol in figures:
        ax = axes[where[key]]
        for p, d in pol.items():
            xs = sorted(d)
            ys = [mean(d[x]) for x in xs]
            if p == "full":
                ax.axhline(mean([v for vs in d.values() for v in vs]), color="black", ls="--", lw=1.2, label="Full")
                continue
            color, marker, size = STYLE.get(p, (None, "x", 6))
            ax.plot(xs, ys, marker=marker, ms=size, lw=size / 3, color=color, alpha=0.85, label=p)
        ax.set_xscale("log")
        ticks = sorted({x for p, d in pol.items() if p != "full" for x in d})
        ax.set_xticks(ticks, [f"{x:.0%}" if frac else str(int(x)) for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel("KV budget (fraction of length)" if frac else "KV budget (tokens)")
        ax.set_ylabel(metric)
        if metric == "ppl":
            ax.set_yscale("log")
        title = f"{label(key[0])} ({key[1]} prefill)" if task == "retrieval" else metric
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(_suptitle(task, rows), fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)


def _suptitle(task: str, rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})
    mode = rows[0]["mode"]
    what = {
        "perplexity": "streaming perplexity (lower is better)",
        "retrieval": "retrieval score, mean over context lengths",
        "fidelity": "greedy drift from Full (higher is closer)",
        "summarize": "summarisation ROUGE-L",
    }[task]
    return f"{what}; lengths {lengths}; {mode} mode"

"""`run_eval`: run a model under policies x budgets on the accuracy tasks; write tables and plots.

Every task reduces to rows of (policy, budget) -> metrics, with Full run once as the reference.
Rows are written long-form (one metric per row, with Full's value and the ratio to it) so a single
table holds every task: `results.json` (with the run's settings and timings), `results.csv`,
`summary.md` (policy x budget tables) and one PNG per task (metric vs budget, Full as a line).
"""

from __future__ import annotations

import csv
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from h2o_kv.cache import Mode

from . import Budget, budget_tokens, is_fraction

TASKS = ("perplexity", "retrieval", "fidelity", "summarize")
DEFAULT_TASKS = ("perplexity", "retrieval", "fidelity")
DEFAULT_POLICIES = ("h2o", "local", "streamingllm", "tova")
DEFAULT_BUDGETS = (0.05, 0.1, 0.2, 0.5)

# "small" runs in minutes on a laptop CPU (the committed results); "large" is the fuller protocol.
SIZES: dict[str, dict[str, Any]] = {
    "small": dict(
        ppl_windows=4, ppl_length=1024, ppl_chunk=1,
        ret_tasks=("passkey", "niah_single"), ret_contexts=(512, 1024), ret_n=2,
        ret_prefill=("oneshot", "stream"), ret_chunk=16, gen_cap=16,
        fid_n=6, fid_passage=320, fid_new=64, sum_n=8, sum_new=64, sum_doc=768,
    ),
    "large": dict(
        ppl_windows=8, ppl_length=4096, ppl_chunk=1,
        ret_tasks=("passkey", "niah_single", "niah_multikey", "variable_tracking", "common_words"),
        ret_contexts=(1024, 2048, 4096), ret_n=10, ret_prefill=("oneshot", "stream"), ret_chunk=16, gen_cap=None,
        fid_n=16, fid_passage=1024, fid_new=128, sum_n=100, sum_new=64, sum_doc=2048,
    ),
}  # fmt: skip

PLOT_METRICS = {
    "perplexity": ("ppl",),
    "retrieval": ("score",),
    "fidelity": ("top1_vs_full", "agree_frac", "rouge_l_vs_full"),
    "summarize": ("rouge_l", "rouge_l_vs_full"),
}
LOWER_IS_BETTER = {"ppl", "ppl_windows_mean", "ppl_windows_std"}
COLUMNS = (
    "task", "subtask", "prefill", "policy", "budget_frac", "budget_tokens", "length",
    "metric", "value", "full_value", "vs_full", "n", "mode", "chunk",
)  # fmt: skip
_KEYS = {"policy", "budget", "length", "subtask", "n"}


def _configs(policies: Sequence[str], budgets: Sequence[Budget]) -> list[tuple[str, Budget]]:
    """Full first (the reference), then every (policy, budget)."""
    return [("full", None)] + [(p, b) for p in policies if p.lower() != "full" for b in budgets]


def _long_rows(task: str, wide: list[dict], *, prefill: str, mode: str, chunk: int | None) -> list[dict]:
    """Wide task rows -> one row per metric, with Full's value of the same (subtask, length) and the ratio."""
    full = {(r.get("subtask", ""), r["length"]): r for r in wide if r["policy"] == "full"}
    out = []
    for r in wide:
        ref = full.get((r.get("subtask", ""), r["length"]), {})
        tokens = budget_tokens(r["budget"], r["length"])
        for metric, value in r.items():
            if metric in _KEYS:
                continue
            fv = ref.get(metric)
            out.append(
                {
                    "task": task,
                    "subtask": r.get("subtask", ""),
                    "prefill": prefill,
                    "policy": r["policy"],
                    "budget_frac": (r["budget"] if is_fraction(r["budget"]) else tokens / r["length"])
                    if tokens
                    else 1.0,
                    "budget_tokens": tokens if tokens is not None else r["length"],
                    "length": r["length"],
                    "metric": metric,
                    "value": value,
                    "full_value": fv,
                    "vs_full": value / fv if fv else None,
                    "n": r.get("n", ""),
                    "mode": mode,
                    "chunk": chunk if chunk is not None else "",
                    "budget": r["budget"],
                }
            )
    return out


def run_eval(
    model: Any,
    tokenizer: Any,
    *,
    tasks: Sequence[str] = DEFAULT_TASKS,
    policies: Sequence[str] = DEFAULT_POLICIES,
    budgets: Sequence[Budget] = DEFAULT_BUDGETS,
    size: str = "small",
    mode: Mode = "drop",
    corpus: str | None = None,
    data: str | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    chunk: int | None = None,
    overrides: dict[str, Any] | None = None,
    command: str | None = None,
) -> list[dict]:
    """Evaluate `model` under each policy at each budget (fractions or token counts) on `tasks`.

    tasks: "perplexity" (streaming, on `corpus`), "retrieval" (RULER-style, `corpus` as haystack),
    "fidelity" (greedy drift from Full), "summarize" (needs `data`, an XSUM-style JSONL file).
    `chunk` overrides the size's tokens-per-eviction for streaming; `overrides` any size setting.
    Returns the long-form rows; with `out_dir`, also writes the tables and plots there.
    """
    cfg = {**SIZES[size], **(overrides or {})}
    if chunk is not None:
        cfg["ppl_chunk"] = cfg["ret_chunk"] = chunk
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; choose from {', '.join(TASKS)}")
    if "summarize" in tasks and not data:
        raise ValueError("the summarize task needs a JSONL file (data=..., CLI --data) with document and summary")
    configs = _configs(policies, budgets)
    units = {
        "perplexity": len(configs),
        "retrieval": len(cfg["ret_contexts"]) * (1 + (len(configs) - 1) * len(cfg["ret_prefill"])),
        "fidelity": len(configs),
        "summarize": len(configs),
    }
    bar = tqdm(total=sum(units[t] for t in tasks), disable=not progress, desc="eval", unit="run")
    rows: list[dict] = []
    timings: dict[str, float] = {}
    for task in tasks:
        bar.set_description(task)
        start = time.perf_counter()
        rows += _run_task(task, model, tokenizer, configs, cfg, mode=mode, corpus=corpus, data=data, seed=seed, bar=bar)
        timings[task] = round(time.perf_counter() - start, 1)
    bar.close()
    if out_dir is not None:
        meta = {
            "command": command,
            "size": size,
            "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
            "tasks": list(tasks),
            "policies": list(policies),
            "budgets": list(budgets),
            "mode": mode,
            "corpus": corpus or "shakespeare (bundled, offline)",
            "data": data,
            "seed": seed,
            "seconds": timings,
            "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
            "versions": {"python": platform.python_version(), "torch": torch.__version__, **_versions()},
            "threads": torch.get_num_threads(),
        }
        write_results(rows, Path(out_dir), meta)
    return rows


def _versions() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__}


def _run_task(task, model, tokenizer, configs, cfg, *, mode, corpus, data, seed, bar) -> list[dict]:
    """Run one task and return its long-form rows."""
    if task == "perplexity":
        from .perplexity import run_perplexity, text_windows

        windows = text_windows(tokenizer, corpus, n=cfg["ppl_windows"], length=cfg["ppl_length"], seed=seed)
        wide = run_perplexity(model, windows, configs, mode=mode, chunk=cfg["ppl_chunk"], progress=bar)
        for r in wide:
            r["n"] = len(windows)
        return _long_rows(task, wide, prefill="stream", mode=mode, chunk=cfg["ppl_chunk"])
    if task == "retrieval":
        return _run_retrieval(model, tokenizer, configs, cfg, mode=mode, corpus=corpus, seed=seed, bar=bar)
    if task == "fidelity":
        from .fidelity import passage_prompts, run_fidelity

        prompts = passage_prompts(tokenizer, corpus, n=cfg["fid_n"], passage_tokens=cfg["fid_passage"], seed=seed)
        wide = run_fidelity(model, tokenizer, prompts, configs, max_new_tokens=cfg["fid_new"], mode=mode, progress=bar)
        for r in wide:
            r["n"] = len(prompts)
        return _long_rows(task, wide, prefill="oneshot", mode=mode, chunk=None)
    from .summarize import load_jsonl, run_summarize

    records = load_jsonl(data, n=cfg["sum_n"])
    wide = run_summarize(
        model,
        tokenizer,
        records,
        configs,
        max_new_tokens=cfg["sum_new"],
        max_doc_tokens=cfg["sum_doc"],
        mode=mode,
        progress=bar,
    )
    return _long_rows(task, wide, prefill="oneshot", mode=mode, chunk=None)


def _run_retrieval(model, tokenizer, configs, cfg, *, mode, corpus, seed, bar) -> list[dict]:
    """Every context length; Full once per length (its answers do not depend on the prefill setting)."""
    from h2o_kv.data import load_corpus

    from .tasks_run import make_samples, run_retrieval

    haystack = load_corpus(corpus, max_chars=2_000_000)
    rows = []
    for context in cfg["ret_contexts"]:
        samples = make_samples(
            tokenizer, haystack, tasks=cfg["ret_tasks"], context_tokens=context, n=cfg["ret_n"], seed=seed
        )
        kw = dict(chunk=cfg["ret_chunk"], mode=mode, gen_cap=cfg["gen_cap"], progress=bar)
        full = run_retrieval(model, tokenizer, samples, configs[:1], prefill="oneshot", **kw)
        for prefill in cfg["ret_prefill"]:
            wide = full + run_retrieval(model, tokenizer, samples, configs[1:], prefill=prefill, **kw)
            chunk = cfg["ret_chunk"] if prefill == "stream" else None
            rows += _long_rows("retrieval", wide, prefill=prefill, mode=mode, chunk=chunk)
    return rows


# ------------------------------------------------------------------------------------------- output


def write_results(rows: list[dict], out: Path, meta: dict) -> None:
    """results.json (meta + rows), results.csv, summary.md and one PNG per task under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _fmt(r[k]) for k in COLUMNS})
    (out / "summary.md").write_text(summary_markdown(rows, meta))
    for task in dict.fromkeys(r["task"] for r in rows):
        plot_task([r for r in rows if r["task"] == task], task, out / f"{task}.png")


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return "" if v is None else v


def _x(r: dict) -> float:
    return r["budget_frac"] if r["budget"] is None or is_fraction(r["budget"]) else r["budget_tokens"]


def _panels(rows: list[dict], metric: str) -> dict[tuple, dict[str, dict[float, list[float]]]]:
    """{(subtask, prefill): {policy: {x: [values]}}} for one metric (values averaged by the caller)."""
    panels: dict[tuple, dict[str, dict[float, list[float]]]] = {}
    for r in rows:
        if r["metric"] != metric:
            continue
        key = (r["subtask"], r["prefill"]) if r["task"] == "retrieval" else (metric,)
        panels.setdefault(key, {}).setdefault(r["policy"], {}).setdefault(_x(r), []).append(r["value"])
    return panels


def summary_markdown(rows: list[dict], meta: dict) -> str:
    """Policy x budget tables of each task's main metrics (means over subtasks' lengths where several)."""
    lines = ["# h2o-kv eval summary (generated by the command below; do not edit)", ""]
    if meta.get("command"):
        lines += ["```", meta["command"], "```", ""]
    lines += [f"Seconds per task: {meta.get('seconds')}", ""]
    for task in dict.fromkeys(r["task"] for r in rows):
        trows = [r for r in rows if r["task"] == task]
        for metric in PLOT_METRICS[task]:
            for key, pol in _panels(trows, metric).items():
                xs = sorted({x for p, d in pol.items() if p != "full" for x in d})
                title = " / ".join(str(k) for k in key if k)
                lines += [f"## {task}: {title}" + (" (higher is better)" if metric not in LOWER_IS_BETTER else ""), ""]
                head = "| policy | " + " | ".join(_xlabel(x, trows) for x in xs) + " |"
                lines += [head, "|" + "---|" * (len(xs) + 1)]
                full = pol.get("full", {})
                full_v = _mean([v for vs in full.values() for v in vs])
                if full:
                    lines.append("| full | " + " | ".join(_num(full_v) for _ in xs) + " |")
                for p, d in pol.items():
                    if p != "full":
                        lines.append(f"| {p} | " + " | ".join(_num(_mean(d.get(x, []))) for x in xs) + " |")
                lines.append("")
                if metric in LOWER_IS_BETTER and full:
                    lines += [f"## {task}: {title}, change vs Full", "", head, "|" + "---|" * (len(xs) + 1)]
                    for p, d in pol.items():
                        if p != "full":
                            rel = [_mean(d.get(x, [])) / full_v - 1 for x in xs]
                            lines.append(
                                f"| {p} | " + " | ".join("" if math.isnan(v) else f"{v:+.1%}" for v in rel) + " |"
                            )
                    lines.append("")
    return "\n".join(lines)


def _xlabel(x: float, rows: list[dict]) -> str:
    frac = all(r["budget"] is None or is_fraction(r["budget"]) for r in rows)
    return f"{x:.0%}" if frac else f"{int(x)} tok"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _num(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.3g}" if abs(v) >= 10 else f"{v:.3f}"


# (colour, marker, size): sizes shrink down the list so equal values stay visible on top of each other
STYLE = {
    "h2o": ("tab:red", "o", 10),
    "local": ("tab:blue", "s", 8),
    "streamingllm": ("tab:green", "^", 6),
    "tova": ("tab:purple", "D", 4),
}


def plot_task(rows: list[dict], task: str, path: Path) -> None:
    """One PNG per task: a panel per (metric, subtask/prefill); one line per policy, Full dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, key, pol) for m in PLOT_METRICS[task] for key, pol in _panels(rows, m).items()]
    if not panels:
        return
    if task == "retrieval":  # rows: prefill settings; columns: subtasks
        subtasks = list(dict.fromkeys(k[0] for _, k, _ in panels))
        prefills = list(dict.fromkeys(k[1] for _, k, _ in panels))
        nrows, ncols = len(prefills), len(subtasks)
        where = {k: (prefills.index(k[1]), subtasks.index(k[0])) for _, k, _ in panels}
    else:
        nrows, ncols = 1, len(panels)
        where = {k: (0, i) for i, (_, k, _) in enumerate(panels)}
    width = max(6.4, 4.2 * ncols)  # room for the title when there is a single panel
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.6 * nrows), squeeze=False)
    frac = all(r["budget"] is None or is_fraction(r["budget"]) for r in rows)
    for metric, key, pol in panels:
        ax = axes[where[key]]
        for p, d in pol.items():
            xs = sorted(d)
            ys = [_mean(d[x]) for x in xs]
            if p == "full":
                ax.axhline(_mean([v for vs in d.values() for v in vs]), color="black", ls="--", lw=1.2, label="Full")
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
        title = f"{key[0]} ({key[1]} prefill)" if task == "retrieval" else metric
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(_suptitle(task, rows), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def command_line() -> str:
    """The command that is running, for the results' provenance."""
    prog = Path(sys.argv[0])
    if prog.name == "cli.py" and prog.parent.name == "eval":
        name = "python -m h2o_kv.eval.cli"
    else:
        name = prog.name
    return " ".join([name, *sys.argv[1:]])

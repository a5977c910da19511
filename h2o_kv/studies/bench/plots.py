"""The bench's four figures: decode tokens/s, step time as the context grows, KV bytes, same memory.

Drawn from the first thread count's rows (the default), one line or bar per policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from h2o_kv.studies.bench.config import Row
from h2o_kv.studies.report import pyplot, save_figure


def plot_all(sweep: list[Row], same: list[Row], out: Path) -> dict[str, Path]:
    """The four figures as PNG files in `out`; returns their paths."""
    plt = pyplot()
    if sweep:
        sweep = [r for r in sweep if r["threads"] == sweep[0]["threads"]]
    figures = {
        "plot_decode": ("decode_tok_s.png", _plot_decode, sweep),
        "plot_steps": ("step_time_vs_context.png", _plot_steps, sweep),
        "plot_kv": ("kv_bytes.png", _plot_kv, sweep),
        "plot_same_memory": ("same_memory.png", _plot_same_memory, same),
    }
    return {name: save_figure(draw(plt, rows), out / filename) for name, (filename, draw, rows) in figures.items()}


def _panels_by_batch(plt, sweep: list[Row], title: str) -> tuple[Any, dict[int, Any]]:
    batches = sorted({r["batch"] for r in sweep})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), squeeze=False)
    fig.suptitle(f"{title}, {sweep[0]['threads']} threads, {sweep[0]['dtype']}")
    return fig, dict(zip(batches, axes[0]))


def _log2_axis(ax, lens: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [str(n) for n in lens])
    ax.minorticks_off()


def _policies(sweep: list[Row]) -> list[str]:
    return list(dict.fromkeys(r["policy"] for r in sweep))


def _series(sweep: list[Row], policy: str, batch: int, key: str) -> dict[int, Any]:
    """{prompt length: row[key]} for one policy at one batch size."""
    return {r["prompt_len"]: r[key] for r in sweep if r["policy"] == policy and r["batch"] == batch}


def _plot_decode(plt, sweep: list[Row]):
    fig, axes = _panels_by_batch(plt, sweep, "Decode throughput (tokens/s summed over the batch)")
    for batch, ax in axes.items():
        for policy in _policies(sweep):
            runs = sorted(_series(sweep, policy, batch, "decode_tok_s").items())
            ax.plot(*zip(*runs), marker="o", label=policy)
        _log2_axis(ax, sorted({r["prompt_len"] for r in sweep}))
        ax.set(title=f"batch {batch}", xlabel="prompt length", ylabel="tokens/s")
        ax.legend(fontsize=8)
    return fig


def _plot_steps(plt, sweep: list[Row]):
    fig, axes = _panels_by_batch(plt, sweep, "Time per decoding step as the context grows")
    colors = {p: f"C{i}" for i, p in enumerate(_policies(sweep))}
    for batch, ax in axes.items():
        labelled = set()
        for r in (r for r in sweep if r["batch"] == batch):
            context = range(r["prompt_len"], r["prompt_len"] + len(r["step_ms"]))
            label = None if r["policy"] in labelled else r["policy"]
            ax.plot(context, r["step_ms"], color=colors[r["policy"]], lw=1, label=label)
            labelled.add(r["policy"])
        _log2_axis(ax, sorted({r["prompt_len"] for r in sweep}))
        ax.set(title=f"batch {batch}", xlabel="tokens in context", ylabel="ms per step")
        ax.legend(fontsize=8)
    return fig


def _plot_kv(plt, sweep: list[Row]):
    batch = max(r["batch"] for r in sweep)
    lens = sorted({r["prompt_len"] for r in sweep})
    policies = _policies(sweep)
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, policy in enumerate(policies):
        kv = _series(sweep, policy, batch, "kv_bytes")
        mib = [kv.get(n, 0) / 2**20 for n in lens]
        ax.bar([j + i * width for j in range(len(lens))], mib, width, label=policy)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lens))], [str(n) for n in lens])
    title = f"KV cache after the run (keys + values, batch {batch})"
    ax.set(title=title, xlabel="prompt length", ylabel="MiB")
    ax.legend(fontsize=8)
    return fig


def _plot_same_memory(plt, same: list[Row]):
    fig, ax = plt.subplots(figsize=(5.5, 4))
    if not same:
        ax.text(0.5, 0.5, "no same-memory run", ha="center", va="center")
        return fig
    labels = [f"{r['policy']}\nbatch {r['batch']}" for r in same]
    bars = ax.bar(labels, [r["decode_tok_s"] for r in same], color=[f"C{i}" for i in range(len(same))])
    ax.bar_label(bars, [f"KV {r['kv_bytes'] / 2**20:.0f} MiB" for r in same], fontsize=8)
    cap, prompt_len = same[0]["cap_bytes"] / 2**20, same[0]["prompt_len"]
    ax.set(title=f"Same KV memory ({cap:.0f} MiB), prompt {prompt_len}", ylabel="decode tokens/s")
    return fig

"""The serving benchmark's files: serve.json (everything), serve.csv (one row per config), serve.png."""

from __future__ import annotations

from pathlib import Path

from h2o_kv.studies.report import pyplot, save_figure, write_csv, write_json

COLUMNS = (
    "config requests errors prompt_tokens generated_tokens wall_s requests_per_s generated_tokens_per_s "
    "ttft_s_p50 ttft_s_p90 ttft_s_p99 latency_s_p50 latency_s_p90 latency_s_p99 tpot_s_p50 tpot_s_p90 tpot_s_p99 "
    "peak_running peak_waiting peak_kv_bytes kv_bytes_allowed replicas replica_kv_peak_over_allowed first_error"
).split()

PANELS = (
    ("peak_running", "peak concurrent sequences"),
    ("generated_tokens_per_s", "generated tokens / s"),
    ("ttft_s_p50", "time to first token p50 (s)"),
    ("latency_s_p50", "request latency p50 (s)"),
)


def write_results(rows: list[dict], ratios: dict, meta: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": write_json(out / "serve.json", dict(meta=meta, results=rows, ratios_vs_full=ratios)),
        "csv": write_csv(out / "serve.csv", COLUMNS, rows),
        "plot": plot(rows, meta, out / "serve.png"),
    }
    return paths


def plot(rows: list[dict], meta: dict, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    names = [row["config"] for row in rows]
    colors = ["tab:blue" if not name.startswith("full") else "tab:gray" for name in names]
    for ax, (key, title) in zip(axes, PANELS):
        values = [row.get(key) or 0.0 for row in rows]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    server = meta.get("server", {})
    fig.suptitle(
        f"h2o-kv serve, {server.get('model')}, KV memory {server.get('kv_memory')}: {meta.get('requests')} requests "
        f"x {meta.get('prompt_tokens')}-token prompts, {meta.get('max_tokens')} new tokens, "
        f"{meta.get('concurrency')} in flight",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, path)

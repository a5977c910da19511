"""The bench's files: bench.json (everything), CSV tables, bars.txt and the plots."""

from __future__ import annotations

from pathlib import Path

from h2o_kv.studies.bench.bars import check_bars, format_bars
from h2o_kv.studies.bench.config import Row
from h2o_kv.studies.bench.plots import plot_all
from h2o_kv.studies.bench.sweep import RATIO_KEYS
from h2o_kv.studies.report import command_line, environment, write_csv, write_json

_VS = [f"{key}_vs_{label}" for key in RATIO_KEYS for label in ("dynamic", "static")]
SWEEP_COLUMNS = (
    "policy policy_desc budget budget_tokens prompt_len gen_len batch threads dtype repeats interleaved prefill_chunk "
    "prefill_s prefill_tok_s decode_s decode_tok_s step_ms_first step_ms_last kv_bytes cache_bytes "
    "kv_bytes_ratio cache_bytes_ratio".split()
    + _VS
    + "seen_tokens kept_tokens peak_mem_bytes peak_mem_delta_bytes mem_kind roofline_ms roofline_frac "
    "bandwidth_gb_s bandwidth_best_gb_s roofline_best_ms".split()
)
SAME_MEMORY_COLUMNS = (
    "policy policy_desc prompt_len gen_len batch threads dtype cap_bytes kv_bytes_per_seq kv_bytes decode_s "
    "decode_tok_s seen_tokens kept_tokens peak_mem_bytes peak_mem_delta_bytes mem_kind"
).split()
STEP_COLUMNS = ["policy", "threads", "prompt_len", "batch", "step", "context", "step_ms"]
FILES = dict(json="bench.json", csv="bench.csv", steps_csv="step_times.csv",
             same_memory_csv="same_memory.csv", bars="bars.txt")  # fmt: skip


def write_results(rows: list[Row], out_dir: str | Path, command: str | None = None) -> dict[str, Path]:
    """Write bench.json, the CSV tables, bars.txt and the PNG plots into `out_dir`; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = [r for r in rows if r["section"] == "sweep"]
    same = [r for r in rows if r["section"] == "same_memory"]
    bars = check_bars(rows)
    paths = {name: out / filename for name, filename in FILES.items()}
    meta = dict(command=command or command_line(), environment=environment())
    write_json(paths["json"], dict(meta, sweep=sweep, same_memory=same, bars=bars))
    write_csv(paths["csv"], SWEEP_COLUMNS, sweep)
    write_csv(paths["steps_csv"], STEP_COLUMNS, step_rows(sweep))
    write_csv(paths["same_memory_csv"], SAME_MEMORY_COLUMNS, same)
    paths["bars"].write_text(format_bars(bars) + "\n")
    return paths | plot_all(sweep, same, out)


def step_rows(sweep: list[Row]) -> list[Row]:
    """Long table of step times: step i of a run decodes with prompt_len + i tokens already seen."""
    return [
        dict(policy=r["policy"], threads=r["threads"], prompt_len=r["prompt_len"], batch=r["batch"], step=i,
             context=r["prompt_len"] + i, step_ms=ms)
        for r in sweep
        for i, ms in enumerate(r["step_ms"])
    ]  # fmt: skip

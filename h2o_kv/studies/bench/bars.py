"""The performance bars the implementation must meet, and the printed summary table."""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

from h2o_kv.studies.bench.config import DYNAMIC, SIZES, STATIC, Row

BAR_SIZE = (4096, 4)  # (prompt, batch) at which the performance bars are defined
RATIO_BARS = (  # (bar, ours, reference, measure, comparison, limit)
    ("decode H2O >= 2.5x full-sdpa (DynamicCache) tok/s", "h2o", DYNAMIC, "decode_tok_s", ">=", 2.5),
    ("decode H2O >= 1.6x static-sdpa (StaticCache) tok/s", "h2o", STATIC, "decode_tok_s", ">=", 1.6),
    ("decode H2O >= 0.85x Local tok/s", "h2o", "local", "decode_tok_s", ">=", 0.85),
    ("prefill H2O <= 1.3x full-sdpa time", "h2o", DYNAMIC, "prefill_s", "<=", 1.3),
    ("prefill H2O <= 1.3x static-sdpa time", "h2o", STATIC, "prefill_s", "<=", 1.3),
)
SAME_MEMORY_BARS = (  # the int8 one only where `h2o-int8` ran: its storage makes the batch bigger still
    ("same memory: H2O's bigger batch >= 4x static-sdpa tok/s", "h2o", STATIC, 4.0),
    ("same memory, int8 KV: H2O's bigger batch >= 4x static-sdpa tok/s", "h2o-int8", STATIC, 4.0),
)
ROOFLINE_LIMIT = 1.5  # H2O's last decode step within 1.5x of weights + kept KV read once
TABLE = [  # the printed summary's (header, width)
    ("policy", 13), ("threads", 8), ("prompt", 7), ("batch", 6), ("prefill s", 10), ("decode tok/s", 13),
    ("vs dyn", 7), ("vs static", 10), ("KV MiB", 9), ("KV ratio", 9), ("peak+ MiB", 10), ("kept/seen", 12),
]  # fmt: skip


def check_bars(rows: list[Row], defined_at: tuple[int, int] = BAR_SIZE) -> list[Row]:
    """PASS (True) / FAIL (False) / SKIP (None) for each performance bar, at the largest prompt and batch
    of the sweep and the first thread count. The speed bars are defined at `defined_at` (4096 tokens, batch 4):
    a run whose largest shape is another SKIPs them and says why (`format_bars`: once); the KV-bytes bar holds at
    any shape."""
    sweep = [r for r in rows if r["section"] == "sweep"]
    if not sweep:
        return []
    threads = sweep[0]["threads"]
    sweep = [r for r in sweep if r["threads"] == threads]
    size = (max(r["prompt_len"] for r in sweep), max(r["batch"] for r in sweep))
    at = {r["policy"]: r for r in sweep if (r["prompt_len"], r["batch"]) == size}
    where = f" at prompt {size[0]}, batch {size[1]}, {threads} threads"
    off = None if size == defined_at else (f"defined at prompt {defined_at[0]} x batch {defined_at[1]}; this run's "
                                           f"largest is {size[0]} x {size[1]}{_runs_it(defined_at)}")  # fmt: skip
    kv = "KV bytes H2O = budget share of full-sdpa"
    checks = [(name, ours, ref, partial(_ratio_bar, key=key, op=op, limit=limit))
              for name, ours, ref, key, op, limit in RATIO_BARS]  # fmt: skip
    checks.append((kv, "h2o", DYNAMIC, _kv_bar))
    checks.append((f"H2O decode step within {ROOFLINE_LIMIT}x of the bandwidth floor", "h2o", "h2o", _roofline_bar))
    bars = [dict(bar=name, passed=None, detail=off) if off and name != kv
            else _bar(name, at.get(ours), at.get(ref), check, f"{ours} and {ref}", where)
            for name, ours, ref, check in checks]  # fmt: skip
    same = {r["policy"]: r for r in rows if r["section"] == "same_memory"}
    for name, ours, ref, limit in SAME_MEMORY_BARS:
        if ours != SAME_MEMORY_BARS[0][1] and ours not in same:
            continue
        check = partial(_ratio_bar, key="decode_tok_s", op=">=", limit=limit)
        needs = f"same-memory {ours} and {ref}"
        bars.append(dict(bar=name, passed=None, detail=off) if off else _bar(name, same.get(ours), same.get(ref),
                                                                              check, needs, ""))  # fmt: skip
    return bars


def _runs_it(shape: tuple[int, int]) -> str:
    """Which --size preset's largest prompt and batch are `shape`, as a hint."""
    names = [name for name, s in SIZES.items() if (max(s["prompt_lens"]), max(s["batch_sizes"])) == shape]
    return f" (--size {names[0]} runs it)" if names else ""


def _bar(name: str, ours: Row | None, ref: Row | None, check, needs: str, where: str) -> Row:
    if ours is None or ref is None:
        return dict(bar=name, passed=None, detail=f"needs {needs}{where}")
    passed, detail = check(ours, ref)
    return dict(bar=name, passed=passed, detail=detail + where)


def _ratio_bar(ours: Row, theirs: Row, key: str, op: str, limit: float) -> tuple[bool, str]:
    ratio = ours[key] / theirs[key]
    passed = ratio >= limit if op == ">=" else ratio <= limit
    detail = f"{key} {ours[key]:.4g} vs {theirs[key]:.4g}: {ratio:.2f}x (needs {op} {limit}x)"
    if ours["section"] == "same_memory":
        detail += f"; batch {ours['batch']} vs {theirs['batch']}"
    return passed, detail


def _kv_bar(h2o: Row, full: Row, tolerance: float = 0.02) -> tuple[bool, str]:
    """H2O keeps its budget plus the one slot an incoming token takes; Full keeps prompt + generated."""
    ratio = h2o["kv_bytes"] / full["kv_bytes"]
    expected = (h2o["budget_tokens"] + 1) / (full["prompt_len"] + full["gen_len"])
    passed = abs(ratio / expected - 1) <= tolerance
    if isinstance(h2o["budget"], float):  # a fraction of the prompt: never above it
        passed = passed and ratio <= h2o["budget"] * (1 + tolerance)
    return passed, (
        f"{h2o['kv_bytes']} vs {full['kv_bytes']} bytes: {ratio:.4f} (budget {h2o['budget']:g}; expected "
        f"(budget_tokens + 1) / (prompt + gen) = {expected:.4f}; with slot bookkeeping "
        f"{h2o['cache_bytes'] / full['kv_bytes']:.4f})"
    )


def _roofline_bar(h2o: Row, _: Row) -> tuple[bool, str]:
    frac = h2o.get("roofline_frac")
    if frac is None:
        return False, "no roofline measured"
    passed = 1 / frac <= ROOFLINE_LIMIT
    steps = h2o.get("step_ms") or []
    median = f"; the median step {statistics.median(steps):.1f} ms" if steps else ""  # the VM's noise, for scale
    best_ms = h2o.get("roofline_best_ms")
    best = (
        f"; against the best read ({h2o['bandwidth_best_gb_s']:.1f} GB/s) {h2o['step_ms_last'] / best_ms:.2f}x"
        if best_ms
        else ""
    )
    return passed, (
        f"last step {h2o['step_ms_last']:.1f} ms vs floor {h2o['roofline_ms']:.1f} ms "
        f"({h2o['bandwidth_gb_s']:.1f} GB/s, the median read in turn): {1 / frac:.2f}x (needs <= {ROOFLINE_LIMIT}x)"
        f"{best}{median}"
    )


def format_bars(bars: list[Row]) -> str:
    """One line per bar; bars that SKIP for the same reason (a run at another shape) share one line."""
    labels = {True: "PASS", False: "FAIL", None: "SKIP"}
    skipped: dict[str, list[str]] = {}
    for b in bars:
        if b["passed"] is None:
            skipped.setdefault(b["detail"], []).append(b["bar"])
    lines = []
    for b in bars:
        same = skipped.get(b["detail"], []) if b["passed"] is None else []
        if len(same) < 2:
            lines.append(f"{labels[b['passed']]}  {b['bar']}: {b['detail']}")
        elif b["bar"] == same[0]:  # the reason once, where its first bar stood
            lines.append(f"SKIP  {len(same)} performance bars: {b['detail']}")
    return "\n".join(lines)


def summary_table(rows: list[Row]) -> str:
    """A compact text table of the sweep and the same-memory rows."""
    lines = [_table_line(name for name, _ in TABLE)]
    if any(r.get("interleaved") or r.get("mem_kind", "").endswith("-together") for r in rows):
        lines.insert(0, "interleaved: the caches of each size decoded in turn, one step each (--interleave)")
    for r in rows:
        cells = (
            r["policy"], r["threads"], r["prompt_len"], r["batch"], _num(r.get("prefill_s"), ".2f"),
            f"{r['decode_tok_s']:.1f}", _num(r.get("decode_tok_s_vs_dynamic"), ".2f"),
            _num(r.get("decode_tok_s_vs_static"), ".2f"), f"{r['kv_bytes'] / 2**20:.1f}",
            _num(r.get("kv_bytes_ratio"), ".3f"), f"{r['peak_mem_delta_bytes'] / 2**20:.0f}",
            f"{r['kept_tokens']}/{r['seen_tokens']}",
        )  # fmt: skip
        lines.append(_table_line(cells) + ("  same memory" if r["section"] == "same_memory" else ""))
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _table_line(cells: Any) -> str:
    """The first cell left-aligned, the rest right-aligned, in TABLE's widths."""
    return "".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, (_, w)) in enumerate(zip(cells, TABLE)))

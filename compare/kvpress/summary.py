"""Tables from run_kvpress.py's per-cell cache: results.csv (one row per cell) and summary.md."""

from __future__ import annotations

import csv
from pathlib import Path

# SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64, keys + values, float32
LAYERS, KV_HEADS, HEAD_DIM, BYTES = 30, 3, 64, 4
PER_TOKEN = LAYERS * KV_HEADS * HEAD_DIM * 2 * BYTES
TASK_NAMES = {"niah_single": "niah", "passkey": "passkey", "variable_tracking": "vt"}
COLUMNS = (
    "press", "ratio", "kept_frac", "task", "context", "n", "expected_n", "questions", "score", "full_correct_n",
    "score_on_full_correct", "kv_bytes_mean", "kv_tokens_mean", "kv_tokens_effective_mean",
    "h2o_kv_budget_tokens", "h2o_kv_bytes_at_budget", "prefill_s_mean", "decode_s_mean",
)  # fmt: skip


def per_token(records: list[dict]) -> int:
    """KV bytes per token of the samples' model (exported with them; older exports: SmolLM2-135M's)."""
    return records[0].get("kv_bytes_per_token", PER_TOKEN) if records else PER_TOKEN


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _scores(results) -> list[float]:
    """Every question's score of these samples (a sample with several questions counts each)."""
    return [v for r in results for v in r.get("scores", [r["score"]])]


def rows(state: dict, records: list[dict]) -> list[dict]:
    """One row per (press, ratio, task, context) cell, in press order, with Full's correct samples."""
    expected: dict[tuple, list[dict]] = {}
    for r in records:
        expected.setdefault((r["task"], r["context_tokens"]), []).append(r)
    cells = state["cells"]
    full_ok = {
        (c["task"], c["context"]): {sid for sid, s in c["samples"].items() if s["score"] == 1.0}
        for c in cells.values()
        if c["press"] == "full"
    }
    out = []
    for c in cells.values():
        s = c["samples"]
        ok = full_ok.get((c["task"], c["context"]), set())
        recs = expected.get((c["task"], c["context"]), [])
        frac = None if c["ratio"] is None else round(1 - c["ratio"], 6)
        budget = recs[0]["h2o_kv_budget_tokens"].get(str(frac)) if recs and frac is not None else None
        out.append(
            {
                "press": c["press"],
                "ratio": c["ratio"] if c["ratio"] is not None else 0.0,
                "kept_frac": frac if frac is not None else 1.0,
                "task": c["task"],
                "context": c["context"],
                "n": len(s),
                "expected_n": len(recs),
                "questions": len(_scores(s.values())),
                "score": _mean(_scores(s.values())),
                "full_correct_n": len(ok & set(s)),
                "score_on_full_correct": _mean(_scores(v for k, v in s.items() if k in ok)),
                "kv_bytes_mean": _mean([v["kv_bytes"] for v in s.values()]),
                "kv_tokens_mean": _mean([v["kv_tokens"] for v in s.values()]),
                "kv_tokens_effective_mean": _mean([v["kv_tokens_effective"] for v in s.values()]),
                "h2o_kv_budget_tokens": budget if budget is not None else "",
                "h2o_kv_bytes_at_budget": budget * per_token(recs) if budget is not None else "",
                "prefill_s_mean": _mean([v["prefill_s"] for v in s.values()]),
                "decode_s_mean": _mean([v["decode_s"] for v in s.values()]),
            }
        )
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if v != v else f"{v:.4g}"
    return str(v)


def _table(title: str, rs: list[dict], cols: list[tuple], value, note: str = "") -> list[str]:
    presses = list(dict.fromkeys(r["press"] for r in rs))
    head = "| press | " + " | ".join(f"{TASK_NAMES.get(t, t)} {c // 1024}k" for t, c in cols) + " |"
    lines = [f"### {title}", ""] + ([note, ""] if note else []) + [head, "|" + "---|" * (len(cols) + 1)]
    for p in presses:
        by = {(r["task"], r["context"]): r for r in rs if r["press"] == p}
        lines.append(f"| {p} | " + " | ".join(value(by[c]) if c in by else "" for c in cols) + " |")
    return lines + [""]


def _score(r: dict) -> str:
    partial = "" if r["n"] >= r["expected_n"] else f" ({r['n']}/{r['expected_n']})"
    return f"{r['score']:.2f}{partial}"


def markdown(table: list[dict], state: dict, records: list[dict]) -> str:
    every = {(r["task"], r["context_tokens"]) for r in records} | {(r["task"], r["context"]) for r in table}
    order = list(TASK_NAMES) + sorted({t for t, _ in every} - set(TASK_NAMES))  # RULER's thirteen: by name, after
    cols = sorted(every, key=lambda x: (order.index(x[0]), x[1]))
    n_cfg = len({(r["press"], r["ratio"]) for r in table})
    done_ids = {sid for c in state["cells"].values() for sid in c["samples"]}
    count = {sid: sum(sid in c["samples"] for c in state["cells"].values()) for sid in done_ids}
    complete = [r for r in records if count.get(r["id"], 0) >= n_cfg]
    done = len(complete) == len(records) and all(r["n"] >= r["expected_n"] for r in table)
    per_col = ", ".join(
        f"{TASK_NAMES.get(t, t)} {c // 1024}k {sum(1 for r in complete if (r['task'], r['context_tokens']) == (t, c))}"
        f"/{sum(1 for r in records if (r['task'], r['context_tokens']) == (t, c))}"
        for t, c in cols
    )
    meta = state.get("meta", {})
    asks = meta.get("questions", 1)
    lines = [
        "# kvpress 0.5.5 on h2o-kv's retrieval samples (generated by run_kvpress.py; do not edit)",
        "",
        f"Each context compressed once, then up to {asks} questions answered from it one after another, each question"
        " and answer cut from the cache before the next (kvpress's pipeline, `questions=[...]`; a sample's score is"
        " the mean of its questions', as h2o-kv's `--questions` rows), greedy"
        if asks > 1
        else "The context alone compressed, then the question and answer prefix fed uncompressed (query-agnostic, "
        "kvpress's default), greedy"
        if meta.get("setting") == "query-agnostic"
        else "Whole prompt (context + question + answer prefix) compressed in one call (h2o-kv's `oneshot`), greedy",
        "answers, RULER string match. "
        + ("All cells complete." if done else "**PARTIAL: cells marked (done/total).**"),
        "",
        f"Samples with all {n_cfg} configurations done: {len(complete)} of {len(records)} ({per_col}); "
        f"{len(done_ids)} started.",
        "",
        f"kvpress {meta.get('kvpress')}, transformers {meta.get('transformers')}, torch {meta.get('torch')}, "
        f"{meta.get('threads')} thread(s), prefill mode `{meta.get('mode')}`, model `{meta.get('model_dir')}`.",
        "",
    ]
    seconds = state.get("seconds", {})
    if seconds:  # runs before the runner timed its samples have none
        total = sum(seconds.values())
        lines[-1:-1] = [
            "",
            f"Run time: {total / 60:.1f} min over {len(seconds)} samples "
            f"({total / len(seconds):.0f} s per sample, all its configurations).",
        ]
    full = [r for r in table if r["press"] == "full"]
    for kept in sorted({r["kept_frac"] for r in table if r["press"] != "full"}, reverse=True):
        rs = full + [r for r in table if r["kept_frac"] == kept and r["press"] != "full"]
        pct = f"{kept:.0%}"
        lines += _table(f"Score at {pct} of the prompt kept (compression_ratio {1 - kept:.3g})", rs, cols, _score)
        lines += _table(
            f"Score at {pct} on the samples Full answers",
            rs,
            cols,
            lambda r: f"{r['score_on_full_correct']:.2f} of {r['full_correct_n']}",
        )
        lines += _table(
            f"KV bytes after the prefill at {pct}, mean per sample (KiB)",
            rs
            + [
                dict(r, press="h2o-kv budget (computed)", kv_bytes_mean=r["h2o_kv_bytes_at_budget"])
                for r in rs
                if r["press"] == "snapkv"
            ],  # fmt: skip
            cols,
            lambda r: "" if r["kv_bytes_mean"] == "" else f"{r['kv_bytes_mean'] / 1024:.0f}",  # no budget exported
            note="Measured: sum of the key/value tensors' bytes in kvpress's cache (float32). AdaKV masks evicted "
            "entries but keeps them in memory, so its bytes equal Full's. The last row is h2o-kv's budget in "
            "tokens x the model's bytes per token (layers x KV heads x head size x 2 x 4 B), not a measurement.",
        )
    return "\n".join(lines)


def write_summary(state: dict, records: list[dict], out: Path) -> None:
    table = rows(state, records)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in table:
            w.writerow({k: _fmt(r[k]) for k in COLUMNS})
    (out / "summary.md").write_text(markdown(table, state, records) + "\n")
    print(f"wrote {out / 'summary.md'} and results.csv ({len(table)} cells)")

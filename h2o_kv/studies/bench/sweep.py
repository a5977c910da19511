"""The whole benchmark: every (thread count, prompt length, batch, policy), ratios against both stock
baselines, the memory-bandwidth floor, and the "same memory, bigger batch" runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from h2o_kv.policies import Budget
from h2o_kv.studies.bench.config import (
    BASELINE_LABELS,
    BASELINES,
    DYNAMIC,
    POLICIES,
    SAME_MEMORY_MAX_BATCH,
    SAME_MEMORY_POLICIES,
    STATIC,
    Row,
    check_run,
    describe,
    new_cache,
    policy_for,
)
from h2o_kv.studies.bench.memory import PeakMemory, kept_and_seen, kv_bytes
from h2o_kv.studies.bench.timing import Reads, bench_together, decode_in_turn, prefill, warm_up

RATIO_KEYS = ("decode_tok_s", "prefill_s", "kv_bytes")  # each reported as <key>_vs_dynamic and <key>_vs_static


def load_text(max_chars: int = 2_000_000) -> str:
    """Real text for the prompts: the project's offline corpus (see `h2o_kv.studies.data`)."""
    from h2o_kv.studies.data import load_corpus

    return load_corpus(max_chars=max_chars)


def prompt_ids(token_ids: list[int], prompt_len: int, batch: int) -> torch.Tensor:
    """[batch, prompt_len] prompts: consecutive slices of the text (wrapping if it is too short)."""
    if not token_ids:
        raise ValueError("the bench text has no tokens")
    need = prompt_len * batch
    flat = (token_ids * (need // len(token_ids) + 1))[:need]
    return torch.tensor(flat, dtype=torch.long).view(batch, prompt_len)


def run_bench(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    policies: Sequence[str] = POLICIES,
    budget: Budget = 0.2,
    prompt_lens: Sequence[int] = (256, 1024),
    gen_len: int = 32,
    batch_sizes: Sequence[int] = (1, 2),
    repeats: int = 1,
    warmup: int = 0,
    threads: Sequence[int | None] = (None,),
    device: str | torch.device | None = None,
    memory_cap_gb: float | None = None,
    prefill_chunk: int | None = None,
    progress: bool = True,
    text: str | None = None,
    interleave: bool = False,
    read_bytes: int = 1 << 29,
) -> list[Row]:
    """Benchmark rows: one per (threads, prompt length, batch, policy), section "sweep", then the
    "same_memory" rows (at the first thread count). `threads` None (or 0) is torch's default count.
    `prefill_chunk` is passed to h2o-kv's caches; `text` replaces the prompt text (default `load_text()`).
    `interleave` runs the policies of each (threads, prompt length, batch) together, their decode steps in
    turn (`bench_together`), so their ratios do not depend on the machine drifting between configurations.
    The floor's rate is the median of `read_bytes` reads, one after each round of decode steps (`timing.Reads`).
    The model's attention implementation and torch's thread count are restored afterwards.
    """
    check_run(policies, budget, prompt_lens, gen_len, batch_sizes, repeats, warmup, threads, prefill_chunk,
              memory_cap_gb)  # fmt: skip
    from tqdm.auto import tqdm

    device = torch.device(device) if device is not None else next(model.parameters()).device
    text = text or load_text(max_chars=8 * max(prompt_lens) * max(batch_sizes))  # ~4 characters a token
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    original, default_threads = model.config._attn_implementation, torch.get_num_threads()
    threads = list(dict.fromkeys(t or default_threads for t in threads))  # 0 / None: the default count
    groups = [[*policies]] if interleave else [[name] for name in policies]
    configs = [(t, n, b, names) for t in threads for n in prompt_lens for b in batch_sizes for names in groups]
    run = dict(budget=budget, gen_len=gen_len, repeats=repeats, warmup=warmup, prefill_chunk=prefill_chunk)
    bar = tqdm(configs, desc="bench", disable=not progress, dynamic_ncols=True)
    rows: list[Row] = []
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reads = Reads(device, threads[0], read_bytes)  # the floor's rate, at the first count, in turn with the steps
    try:
        with torch.inference_mode():
            for count, prompt_len, batch, names in bar:
                if torch.get_num_threads() != count:
                    torch.set_num_threads(count)
                if not rows or rows[-1]["threads"] != torch.get_num_threads():
                    warm_up(model, prompt_ids(token_ids, min(prompt_lens), 1).to(device), policies, budget)
                label = ",".join(names)
                bar.set_postfix_str(f"{label} prompt={prompt_len} batch={batch} threads={torch.get_num_threads()}")
                ids = prompt_ids(token_ids, prompt_len, batch).to(device)
                added = bench_together(model, ids, names, **run, read=reads)
                add_roofline(added, weight_bytes, *reads.rates())
                rows += added
            torch.set_num_threads(threads[0])
            add_ratios(rows)
            bar.set_postfix_str("same memory, bigger batch")
            first = [r for r in rows if r["threads"] == torch.get_num_threads()]
            rows += same_memory(model, token_ids, first, cap_gb=memory_cap_gb, device=device, interleave=interleave)
    finally:
        bar.close()
        model.set_attn_implementation(original)
        torch.set_num_threads(default_threads)
    return rows


def add_ratios(rows: list[Row]) -> None:
    """Each row against each stock baseline at the same (prompt, batch, threads):
    `<key>_vs_dynamic` / `<key>_vs_static` for decode tokens/s, prefill seconds and KV bytes;
    `kv_bytes_ratio` / `cache_bytes_ratio` are the row's bytes over DynamicCache's KV."""
    where = {(r["policy"], r["prompt_len"], r["batch"], r["threads"]): r for r in rows}
    for row in rows:
        size = (row["prompt_len"], row["batch"], row["threads"])
        for baseline in BASELINES:
            ref = where.get((baseline, *size))
            for key in RATIO_KEYS:
                row[f"{key}_vs_{BASELINE_LABELS[baseline]}"] = row[key] / ref[key] if ref and ref[key] else None
        full = where.get((DYNAMIC, *size))
        row["kv_bytes_ratio"] = row["kv_bytes"] / full["kv_bytes"] if full else None
        row["cache_bytes_ratio"] = row["cache_bytes"] / full["kv_bytes"] if full else None


def add_roofline(rows: list[Row], weight_bytes: int, bandwidth: float, best: float | None = None) -> None:
    """Memory-bound floor of a decoding step: read every weight and the kept KV once.

    `roofline_ms` is that floor at the end of the run at `bandwidth` (bytes/s: the median of the plain reads timed
    in turn with the rows' decode steps, `timing.Reads`); `roofline_frac` is how close the last measured step
    came to it (1.0 = at the memory-bandwidth limit); `roofline_best_ms` is the floor at the `best` read.
    """
    for row in rows:
        nbytes = weight_bytes + row["kv_bytes"]
        row["roofline_ms"] = 1000 * nbytes / bandwidth
        row["bandwidth_gb_s"] = bandwidth / 1e9
        row["roofline_frac"] = row["roofline_ms"] / row["step_ms_last"] if row.get("step_ms_last") else None
        if best is not None:
            row["bandwidth_best_gb_s"] = best / 1e9
            row["roofline_best_ms"] = 1000 * nbytes / best


def same_memory(
    model: torch.nn.Module,
    token_ids: list[int],
    sweep: list[Row],
    *,
    cap_gb: float | None,
    device: torch.device,
    interleave: bool = False,
) -> list[Row]:
    """Largest batch whose KV fits the cap, for each stock baseline and for H2O (float32 and int8 KV, when
    swept), and decode throughput there.

    KV bytes per sequence come from the sweep's measurements at the longest prompt. The cap is
    `cap_gb` of KV memory, else the stock caches' measured KV at the largest batch of the sweep.
    With `interleave` every batch is run again, all decoding in turn (`decode_in_turn`).
    """
    prompt_len = max(r["prompt_len"] for r in sweep)
    widest: dict[str, Row] = {}  # per policy, the largest batch measured at the longest prompt
    for row in sorted((r for r in sweep if r["prompt_len"] == prompt_len), key=lambda r: r["batch"]):
        widest[row["policy"]] = row
    stock = [widest[name]["kv_bytes"] for name in BASELINES if name in widest]
    if cap_gb is not None:
        cap = int(cap_gb * 1e9)
    elif stock:
        cap = max(stock)
    else:
        return []
    plan = {}  # name -> (batch, KV bytes per sequence)
    for name in (n for n in SAME_MEMORY_POLICIES if n in widest):
        per_seq = widest[name]["kv_bytes"] / widest[name]["batch"]
        batch = min(SAME_MEMORY_MAX_BATCH, int(cap // per_seq))
        if batch >= 1:
            plan[name] = batch, per_seq
    groups = [list(plan)] if interleave else [[name] for name in plan]
    rows = []
    for names in groups:
        if len(names) == 1 and plan[names[0]][0] == widest[names[0]]["batch"]:  # the sweep ran this: reuse it
            rows.append({key: widest[names[0]][key] for key in SAME_MEMORY_KEYS} | dict(section="same_memory"))
        else:
            rows += run_replicated(model, token_ids, [(widest[name], plan[name][0]) for name in names], device)
    for row in rows:
        row |= dict(cap_bytes=cap, kv_bytes_per_seq=plan[row["policy"]][1])
    return rows


SAME_MEMORY_KEYS = (
    "policy", "policy_desc", "prompt_len", "gen_len", "batch", "threads", "dtype", "kv_bytes", "decode_s",
    "decode_tok_s", "seen_tokens", "kept_tokens", "peak_mem_bytes", "peak_mem_delta_bytes", "mem_kind",
)  # fmt: skip


def run_replicated(model: torch.nn.Module, token_ids: list[int], runs: list[tuple[Row, int]],
                   device: torch.device) -> list[Row]:  # fmt: skip
    """Decode `batch` sequences configured as the sweep row `like`, for each (like, batch) of `runs`, once,
    timed; several runs decode in turn. To stay cheap a prompt is prefilled at batch 1 and the cache
    replicated (identical sequences cost the same per step as distinct ones), except for a StaticCache,
    which is prefilled at the full batch."""
    memory = PeakMemory(device)
    memory.start()
    live, policies = {}, {}
    for like, batch in runs:
        name, prompt_len = like["policy"], like["prompt_len"]
        policies[name] = policy_for(name, like["budget_tokens"] or like["budget"], prompt_len)
        cache = new_cache(model, name, policies[name], max_len=prompt_len + like["gen_len"],
                          prefill_chunk=like["prefill_chunk"])  # fmt: skip
        if name == STATIC:  # a StaticCache is allocated for its first batch and cannot be replicated
            token, _ = prefill(model, cache, prompt_ids(token_ids, prompt_len, batch).to(device))
        else:
            token, _ = prefill(model, cache, prompt_ids(token_ids, prompt_len, 1).to(device))
            cache.batch_repeat_interleave(batch)
            token = token.repeat_interleave(batch, dim=0)
        live[name] = [cache, token]
    like = runs[0][0]
    steps = decode_in_turn(model, live, like["prompt_len"], like["gen_len"])
    peak, peak_delta = memory.stop()
    rows = []
    for (like, batch), (name, (cache, _)) in zip(runs, live.items()):
        decode_s = sum(steps[name])
        kept, seen = kept_and_seen(cache, like["prompt_len"] + like["gen_len"])
        rows.append(dict(
            section="same_memory", policy=name, policy_desc=describe(name, policies[name]),
            prompt_len=like["prompt_len"], gen_len=like["gen_len"], batch=batch, threads=like["threads"],
            dtype=like["dtype"], kv_bytes=kv_bytes(cache)[0], decode_s=decode_s,
            decode_tok_s=batch * like["gen_len"] / decode_s, seen_tokens=seen, kept_tokens=kept,
            peak_mem_bytes=peak, peak_mem_delta_bytes=peak_delta,
            mem_kind=memory.kind + ("-together" if len(runs) > 1 else ""),
        ))  # fmt: skip
    return rows

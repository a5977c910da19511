"""Throughput and memory benchmark: the stock model (SDPA + DynamicCache) against h2o-kv's bounded caches.

Every policy runs the same greedy loop (one prefill call, then one forward per generated token,
argmax) on the same real-text prompts, so the only difference is the cache and its attention path.
Per configuration (policy, prompt length, batch) it records prefill time, decode throughput, the
time of every decoding step as the context grows, the cache's bytes measured from its tensors, and
the peak memory of the run. A second section asks the paper's "same memory, bigger batch" question:
under a KV-memory cap, how large a batch fits for Full and for H2O, and what throughput it gives.

    h2o-kv bench --size small            # CI-sized: 256/1024 tokens, batch 1/2, 32 new tokens
    python -m h2o_kv.bench --size large  # the issue's sizes: 1024 and 4096 tokens, batch 1/4, 64 new tokens
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import json
import os
import platform
import re
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from .attention import enable
from .cache import KVCache
from .policies import Full, Policy, budget_tokens, build

Cache = DynamicCache | KVCache
Row = dict[str, Any]

BASELINE = "full-sdpa"  # the stock model: SDPA attention, transformers' DynamicCache
POLICIES = (BASELINE, "h2o", "local", "streamingllm", "tova")
EXTRA_POLICIES = ("full-kv",)  # h2o_kv.KVCache(Full()): our attention path, no eviction
SIZES: dict[str, dict[str, Any]] = {
    "small": dict(prompt_lens=[256, 1024], batch_sizes=[1, 2], gen_len=32, repeats=1, warmup=0),
    "large": dict(prompt_lens=[1024, 4096], batch_sizes=[1, 4], gen_len=64, repeats=1, warmup=0),
}
SAME_MEMORY_MAX_BATCH = 64  # keeps the "bigger batch" run affordable on a CPU
BAR_SIZE = (4096, 4)  # (prompt, batch) at which the performance bars are defined
FALLBACK_TEXT = (
    "The heavy hitters of attention are a small set of tokens that receive most of the attention mass "
    "in every layer. Keeping them, together with the most recent tokens, lets a language model generate "
    "long texts from a cache that holds only a fraction of the context. The rest of the context is "
    "dropped as the text grows, and the memory saved can serve a larger batch of sequences at once. "
)
SWEEP_COLUMNS = (
    "policy policy_desc budget budget_tokens prompt_len gen_len batch repeats prefill_chunk prefill_s "
    "prefill_tok_s decode_s decode_tok_s step_ms_first step_ms_last kv_bytes cache_bytes kv_bytes_ratio "
    "cache_bytes_ratio seen_tokens kept_tokens peak_mem_bytes peak_mem_delta_bytes mem_kind "
    "roofline_ms roofline_frac bandwidth_gb_s"
).split()
SAME_MEMORY_COLUMNS = (
    "policy policy_desc prompt_len gen_len batch cap_bytes kv_bytes_per_seq kv_bytes decode_s decode_tok_s "
    "seen_tokens kept_tokens peak_mem_bytes peak_mem_delta_bytes mem_kind"
).split()
RATIO_BARS = (  # (bar, ours, reference, measure, comparison, limit)
    ("decode H2O >= 2.5x Full-sdpa tok/s", "h2o", BASELINE, "decode_tok_s", ">=", 2.5),
    ("decode H2O >= 0.85x Local tok/s", "h2o", "local", "decode_tok_s", ">=", 0.85),
    ("prefill H2O <= 1.3x Full-sdpa time", "h2o", BASELINE, "prefill_s", "<=", 1.3),
)
TABLE = [  # the printed summary's (header, width)
    ("policy", 13), ("prompt", 7), ("batch", 6), ("prefill s", 10), ("decode tok/s", 13), ("KV MiB", 9),
    ("KV ratio", 9), ("peak+ MiB", 10), ("kept/seen", 12),
]  # fmt: skip
STEP_COLUMNS = ["policy", "prompt_len", "batch", "step", "context", "step_ms"]


# -- what runs ---------------------------------------------------------------------------------------------
def make_policy(name: str, tokens: int | None) -> Policy | None:
    """The policy called `name` at `tokens` tokens per head (H2O half heavy, half recent;
    StreamingLLM 4 sinks); None for the stock baseline."""
    if name == BASELINE:
        return None
    if name == "full-kv":
        return Full()
    if name == "full":
        raise ValueError(f"say {BASELINE!r} (stock model) or 'full-kv' (h2o-kv's path, no eviction)")
    return build(name, tokens)


def describe(policy: Policy | None) -> str:
    return "Full (SDPA, DynamicCache)" if policy is None else policy.describe()


def new_cache(model: torch.nn.Module, policy: Policy | None, prefill_chunk: int | None = None) -> Cache:
    """A fresh cache, with the model switched to the attention path that cache needs."""
    if policy is None:
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    enable(model)
    return KVCache(policy, prefill_chunk=prefill_chunk)


def load_text(max_chars: int = 2_000_000) -> str:
    """Real text for the prompts: the project's corpus if it can be had, else a built-in paragraph."""
    try:
        from .data import load_corpus

        return load_corpus(max_chars=max_chars)
    except Exception as err:  # any failure (offline, module missing) falls back
        print(f"h2o-kv bench: corpus unavailable ({err}); using a built-in paragraph", file=sys.stderr)
        return FALLBACK_TEXT * 200


def prompt_ids(token_ids: list[int], prompt_len: int, batch: int) -> torch.Tensor:
    """[batch, prompt_len] prompts: consecutive slices of the text (wrapping if it is too short)."""
    need = prompt_len * batch
    flat = (token_ids * (need // max(1, len(token_ids)) + 1))[:need]
    return torch.tensor(flat, dtype=torch.long).view(batch, prompt_len)


# -- measuring ---------------------------------------------------------------------------------------------
def kv_bytes(cache: Cache) -> tuple[int, int]:
    """(keys + values bytes, all cache bytes including slot bookkeeping), from the cache's tensors."""
    keys_values = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None
    )
    return keys_values, cache.nbytes() if isinstance(cache, KVCache) else keys_values


def kept_and_seen(cache: Cache) -> tuple[int, int]:
    """(most tokens any head keeps, tokens that went through the cache)."""
    if isinstance(cache, KVCache):
        return cache.kept_tokens, cache.seen_tokens
    return cache.get_seq_length(), cache.get_seq_length()


class PeakMemory:
    """Peak memory of one region of the run, so each configuration is measured on its own.

    On CUDA: the allocator's peak, reset per region. On Linux CPUs: the kernel's resident-set
    high-water mark (VmHWM), reset per region through /proc/self/clear_refs after freed heap is
    returned to the OS. This isolates configurations without a process each: the peak of a
    long-lived process otherwise only grows. Where the reset is refused the lifetime peak is
    reported and `kind` says so ("rss-lifetime"). Both include everything allocated in the
    region (activations and attention temporaries, not only the cache).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "rss"
        self.base = 0

    def start(self) -> None:
        gc.collect()
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        _malloc_trim()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the RSS high-water mark
        except OSError:
            self.kind = "rss-lifetime"
        self.base = _proc_status_kb("VmRSS") * 1024

    def stop(self) -> tuple[int, int]:
        """(peak bytes, peak bytes above what was resident at `start`)."""
        if self.kind == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            high_water = _proc_status_kb("VmHWM") * 1024
            peak = high_water or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, max(0, peak - self.base)


def _proc_status_kb(field: str) -> int:
    try:
        match = re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def prefill(model: torch.nn.Module, input_ids: torch.Tensor, cache: Cache) -> tuple[torch.Tensor, float]:
    """Run the prompt through the model: (the greedy next token [B, 1], seconds)."""
    start = time.perf_counter()
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(input_ids.device)
    return token, time.perf_counter() - start


def decode_steps(model: torch.nn.Module, token: torch.Tensor, cache: Cache, steps: int) -> list[float]:
    """Seconds per greedy step: each step feeds the previous token and takes the argmax."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(token.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_config(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    name: str,
    *,
    budget: float,
    gen_len: int,
    repeats: int,
    warmup: int,
    prefill_chunk: int | None = None,
) -> Row:
    """One sweep row: medians over `repeats` timed runs (after `warmup` untimed ones) of one configuration."""
    batch, prompt_len = input_ids.shape
    tokens = budget_tokens(budget, prompt_len)
    policy = make_policy(name, tokens)
    memory = PeakMemory(input_ids.device)
    prefills, step_runs, peaks = [], [], []
    for run in range(warmup + repeats):
        memory.start()
        cache = new_cache(model, policy, prefill_chunk)
        token, prefill_s = prefill(model, input_ids, cache)
        steps = decode_steps(model, token, cache, gen_len)
        if run >= warmup:
            prefills.append(prefill_s)
            step_runs.append(steps)
            peaks.append(memory.stop())
        sizes, (kept, seen) = kv_bytes(cache), kept_and_seen(cache)
        del cache
    step_s = [statistics.median(column) for column in zip(*step_runs)]
    prefill_s, decode_s = statistics.median(prefills), statistics.median(map(sum, step_runs))
    peak, peak_delta = max(peaks, key=lambda p: p[1])
    bounded = policy is not None and not isinstance(policy, Full)
    return dict(
        section="sweep", policy=name, policy_desc=describe(policy),
        budget=budget if bounded else None, budget_tokens=tokens if bounded else None,
        prompt_len=prompt_len, gen_len=gen_len, batch=batch, repeats=repeats, prefill_chunk=prefill_chunk,
        prefill_s=prefill_s, prefill_tok_s=batch * prompt_len / prefill_s,
        decode_s=decode_s, decode_tok_s=batch * gen_len / decode_s,
        step_ms=[1000 * s for s in step_s], step_ms_first=1000 * step_s[0], step_ms_last=1000 * step_s[-1],
        kv_bytes=sizes[0], cache_bytes=sizes[1], seen_tokens=seen, kept_tokens=kept,
        peak_mem_bytes=peak, peak_mem_delta_bytes=peak_delta, mem_kind=memory.kind,
    )  # fmt: skip


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second this device reads a large float tensor with (the best of `repeats` sums)."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        data.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def add_roofline(rows: list[Row], weight_bytes: int, bandwidth: float) -> None:
    """Memory-bound floor of a decoding step: read every weight and the kept KV once.

    `roofline_ms` is that floor at the end of the run; `roofline_frac` is how close the last
    measured step came to it (1.0 = at the memory-bandwidth limit).
    """
    for row in rows:
        floor_s = (weight_bytes + row["kv_bytes"]) / bandwidth
        row["roofline_ms"] = 1000 * floor_s
        row["bandwidth_gb_s"] = bandwidth / 1e9
        row["roofline_frac"] = row["roofline_ms"] / row["step_ms_last"] if row.get("step_ms_last") else None


def add_ratios(rows: list[Row]) -> None:
    """kv_bytes_ratio / cache_bytes_ratio: each row's bytes over the baseline's KV at the same size."""
    full = {(r["prompt_len"], r["batch"]): r["kv_bytes"] for r in rows if r["policy"] == BASELINE}
    for row in rows:
        ref = full.get((row["prompt_len"], row["batch"]))
        row["kv_bytes_ratio"] = row["kv_bytes"] / ref if ref else None
        row["cache_bytes_ratio"] = row["cache_bytes"] / ref if ref else None


# -- same memory, bigger batch ------------------------------------------------------------------------------
def same_memory(
    model: torch.nn.Module,
    token_ids: list[int],
    sweep: list[Row],
    *,
    cap_gb: float | None,
    device: torch.device,
) -> list[Row]:
    """Largest batch whose KV fits the cap, for Full and for H2O, and decode throughput at that batch.

    KV bytes per sequence come from the sweep's measurements at the longest prompt. The cap is
    `cap_gb` of KV memory, else Full's measured KV at the largest batch of the sweep.
    """
    prompt_len = max(r["prompt_len"] for r in sweep)
    widest: dict[str, Row] = {}  # per policy, the largest batch measured at the longest prompt
    for row in sorted((r for r in sweep if r["prompt_len"] == prompt_len), key=lambda r: r["batch"]):
        widest[row["policy"]] = row
    if cap_gb is not None:
        cap = int(cap_gb * 1e9)
    elif BASELINE in widest:
        cap = widest[BASELINE]["kv_bytes"]
    else:
        return []
    rows = []
    for name in (n for n in (BASELINE, "h2o") if n in widest):
        per_seq = widest[name]["kv_bytes"] / widest[name]["batch"]
        batch = min(SAME_MEMORY_MAX_BATCH, int(cap // per_seq))
        if batch >= 1:
            row = run_replicated(model, token_ids, widest[name], batch, device)
            rows.append(row | dict(cap_bytes=cap, kv_bytes_per_seq=per_seq))
    return rows


def run_replicated(
    model: torch.nn.Module,
    token_ids: list[int],
    like: Row,
    batch: int,
    device: torch.device,
) -> Row:
    """Decode `batch` sequences configured as the sweep row `like`, once, timed. To stay cheap the
    prompt is prefilled at batch 1 and the cache replicated: identical sequences cost the same per
    step as distinct ones."""
    name, prompt_len, gen_len = like["policy"], like["prompt_len"], like["gen_len"]
    policy = make_policy(name, like["budget_tokens"])
    memory = PeakMemory(device)
    memory.start()
    cache = new_cache(model, policy, like["prefill_chunk"])
    token, _ = prefill(model, prompt_ids(token_ids, prompt_len, 1).to(device), cache)
    cache.batch_repeat_interleave(batch)
    decode_s = sum(decode_steps(model, token.repeat_interleave(batch, dim=0), cache, gen_len))
    peak, peak_delta = memory.stop()
    kept, seen = kept_and_seen(cache)
    return dict(
        section="same_memory", policy=name, policy_desc=describe(policy),
        prompt_len=prompt_len, gen_len=gen_len, batch=batch, kv_bytes=kv_bytes(cache)[0],
        decode_s=decode_s, decode_tok_s=batch * gen_len / decode_s, seen_tokens=seen, kept_tokens=kept,
        peak_mem_bytes=peak, peak_mem_delta_bytes=peak_delta, mem_kind=memory.kind,
    )  # fmt: skip


# -- the whole benchmark ------------------------------------------------------------------------------------
def run_bench(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    policies: Sequence[str] = POLICIES,
    budget: float = 0.2,
    prompt_lens: Sequence[int] = (256, 1024),
    gen_len: int = 32,
    batch_sizes: Sequence[int] = (1, 2),
    repeats: int = 1,
    warmup: int = 0,
    device: str | torch.device | None = None,
    memory_cap_gb: float | None = None,
    prefill_chunk: int | None = None,
    progress: bool = True,
    text: str | None = None,
) -> list[Row]:
    """Benchmark rows: one per (policy, prompt length, batch), section "sweep", then the "same_memory"
    rows. `prefill_chunk` is passed to h2o-kv's caches (bounds their memory during the prefill); `text`
    replaces the prompt text (default `load_text()`). The model's attention implementation is restored.
    """
    _check_sizes(policies, budget, prompt_lens, gen_len, batch_sizes, repeats, warmup)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    text = text or load_text(max_chars=8 * max(prompt_lens) * max(batch_sizes))  # ~4 characters a token
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    configs = [(name, n, b) for n in prompt_lens for b in batch_sizes for name in policies]
    original = model.config._attn_implementation
    run = dict(budget=budget, gen_len=gen_len, repeats=repeats, warmup=warmup, prefill_chunk=prefill_chunk)
    bar = tqdm(configs, desc="bench", disable=not progress, dynamic_ncols=True)
    rows = []
    try:
        with torch.inference_mode():
            warm_up(model, token_ids, policies, budget, min(prompt_lens), device)
            for name, prompt_len, batch in bar:
                bar.set_postfix_str(f"{name} prompt={prompt_len} batch={batch}")
                ids = prompt_ids(token_ids, prompt_len, batch).to(device)
                rows.append(bench_config(model, ids, name, **run))
            add_ratios(rows)
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            add_roofline(rows, weight_bytes, measure_bandwidth(device))
            bar.set_postfix_str("same memory, bigger batch")
            rows += same_memory(model, token_ids, rows, cap_gb=memory_cap_gb, device=device)
    finally:
        bar.close()
        model.set_attn_implementation(original)
    return rows


def _check_sizes(
    policies: Sequence[str],
    budget: float,
    prompt_lens: Sequence[int],
    gen_len: int,
    batch_sizes: Sequence[int],
    repeats: int,
    warmup: int,
) -> None:
    """Reject a run that cannot mean anything before any model call (unknown policy, empty sizes...)."""
    if not policies or not prompt_lens or not batch_sizes:
        raise ValueError("bench needs at least one policy, prompt length and batch size")
    if min(prompt_lens) < 1 or min(batch_sizes) < 1 or gen_len < 1 or repeats < 1 or warmup < 0:
        raise ValueError("prompt lengths, batch sizes, gen_len and repeats must be >= 1 (warmup >= 0)")
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be a fraction of the prompt in (0, 1], got {budget}")
    for name in policies:
        make_policy(name, budget_tokens(budget, min(prompt_lens)))


def warm_up(
    model: torch.nn.Module,
    token_ids: list[int],
    policies: Sequence[str],
    budget: float,
    prompt_len: int,
    device: torch.device,
) -> None:
    """One short untimed run per policy, so the first configuration does not pay one-off costs."""
    ids = prompt_ids(token_ids, prompt_len, 1).to(device)
    for name in policies:
        cache = new_cache(model, make_policy(name, budget_tokens(budget, prompt_len)))
        decode_steps(model, prefill(model, ids, cache)[0], cache, 2)


# -- the bars the implementation must meet -----------------------------------------------------------------
def check_bars(rows: list[Row]) -> list[Row]:
    """PASS (True) / FAIL (False) / SKIP (None) for each performance bar, at the largest prompt and batch
    of the sweep (the bars are defined at 4096 tokens, batch 4; smaller runs say where they measured)."""
    sweep = [r for r in rows if r["section"] == "sweep"]
    if not sweep:
        return []
    size = (max(r["prompt_len"] for r in sweep), max(r["batch"] for r in sweep))
    at = {r["policy"]: r for r in sweep if (r["prompt_len"], r["batch"]) == size}
    where = f" at prompt {size[0]}, batch {size[1]}" + ("" if size == BAR_SIZE else " (bars: 4096 x 4)")
    checks = [(name, ours, ref, partial(_ratio_bar, key=key, op=op, limit=limit))
              for name, ours, ref, key, op, limit in RATIO_BARS]  # fmt: skip
    checks.append(("KV bytes H2O = budget share of Full", "h2o", BASELINE, _kv_bar))
    bars = []
    for name, ours, ref, check in checks:
        if ours in at and ref in at:
            passed, detail = check(at[ours], at[ref])
        else:
            passed, detail = None, f"needs {ours} and {ref}"
        bars.append(dict(bar=name, passed=passed, detail=detail + where))
    return bars


def _ratio_bar(ours: Row, theirs: Row, key: str, op: str, limit: float) -> tuple[bool, str]:
    ratio = ours[key] / theirs[key]
    passed = ratio >= limit if op == ">=" else ratio <= limit
    return passed, f"{key} {ours[key]:.4g} vs {theirs[key]:.4g}: {ratio:.2f}x (needs {op} {limit}x)"


def _kv_bar(h2o: Row, full: Row, tolerance: float = 0.02) -> tuple[bool, str]:
    """H2O keeps its budget plus the one slot an incoming token takes; Full keeps prompt + generated."""
    ratio = h2o["kv_bytes"] / full["kv_bytes"]
    expected = (h2o["budget_tokens"] + 1) / (full["prompt_len"] + full["gen_len"])
    passed = ratio <= h2o["budget"] * (1 + tolerance) and abs(ratio / expected - 1) <= tolerance
    return passed, (
        f"{h2o['kv_bytes']} vs {full['kv_bytes']} bytes: {ratio:.4f} (budget {h2o['budget']:g}; expected "
        f"(budget_tokens + 1) / (prompt + gen) = {expected:.4f}; with slot bookkeeping "
        f"{h2o['cache_bytes'] / full['kv_bytes']:.4f})"
    )


def format_bars(bars: list[Row]) -> str:
    labels = {True: "PASS", False: "FAIL", None: "SKIP"}
    return "\n".join(f"{labels[b['passed']]}  {b['bar']}: {b['detail']}" for b in bars)


# -- output ------------------------------------------------------------------------------------------------
def write_results(rows: list[Row], out_dir: str | Path) -> dict[str, Path]:
    """Write bench.json (everything), CSV tables, bars.txt and PNG plots into `out_dir`; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = [r for r in rows if r["section"] == "sweep"]
    same = [r for r in rows if r["section"] == "same_memory"]
    bars = check_bars(rows)
    paths = {
        name: out / filename
        for name, filename in [
            ("json", "bench.json"), ("csv", "bench.csv"), ("steps_csv", "step_times.csv"),
            ("same_memory_csv", "same_memory.csv"), ("bars", "bars.txt"),
        ]
    }  # fmt: skip
    report = dict(environment=environment(), sweep=sweep, same_memory=same, bars=bars)
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    _write_csv(paths["csv"], SWEEP_COLUMNS, sweep)
    _write_csv(paths["steps_csv"], STEP_COLUMNS, step_rows(sweep))
    _write_csv(paths["same_memory_csv"], SAME_MEMORY_COLUMNS, same)
    paths["bars"].write_text(format_bars(bars) + "\n")
    return paths | plot_all(sweep, same, out)


def environment() -> Row:
    """Where the numbers come from: timings only compare on the same machine."""
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        machine=platform.machine(),
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None,  # busy machine = noisy timings
        cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )


def step_rows(sweep: list[Row]) -> list[Row]:
    """Long table of step times: step i of a run decodes with prompt_len + i tokens already seen."""
    return [
        dict(policy=r["policy"], prompt_len=r["prompt_len"], batch=r["batch"], step=i,
             context=r["prompt_len"] + i, step_ms=ms)
        for r in sweep
        for i, ms in enumerate(r["step_ms"])
    ]  # fmt: skip


def _write_csv(path: Path, columns: list[str], rows: list[Row]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# -- plots -------------------------------------------------------------------------------------------------
def plot_all(sweep: list[Row], same: list[Row], out: Path) -> dict[str, Path]:
    """The four figures (Agg backend, no display needed); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {
        "plot_decode": ("decode_tok_s.png", _plot_decode, sweep),
        "plot_steps": ("step_time_vs_context.png", _plot_steps, sweep),
        "plot_kv": ("kv_bytes.png", _plot_kv, sweep),
        "plot_same_memory": ("same_memory.png", _plot_same_memory, same),
    }
    paths = {}
    for name, (filename, draw, rows) in figures.items():
        fig = draw(plt, rows)
        paths[name] = out / filename
        fig.savefig(paths[name], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def _panels_by_batch(plt, sweep: list[Row], title: str) -> tuple[Any, dict[int, Any]]:
    batches = sorted({r["batch"] for r in sweep})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), squeeze=False)
    fig.suptitle(title)
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
    fig, ax = plt.subplots(figsize=(5, 4))
    if not same:
        ax.text(0.5, 0.5, "no same-memory run", ha="center", va="center")
        return fig
    labels = [f"{r['policy']}\nbatch {r['batch']}" for r in same]
    bars = ax.bar(labels, [r["decode_tok_s"] for r in same], color=[f"C{i}" for i in range(len(same))])
    ax.bar_label(bars, [f"KV {r['kv_bytes'] / 2**20:.0f} MiB" for r in same], fontsize=8)
    cap, prompt_len = same[0]["cap_bytes"] / 2**20, same[0]["prompt_len"]
    ax.set(title=f"Same KV memory ({cap:.0f} MiB), prompt {prompt_len}", ylabel="decode tokens/s")
    return fig


# -- profiling ---------------------------------------------------------------------------------------------
def profile_h2o(
    model: torch.nn.Module, token_ids: list[int], *, prompt_len: int, batch: int, budget: float, out_dir: Path
) -> dict[str, Path]:
    """torch.profiler op tables of an H2O prefill (batch 1) and of one decode step at `batch` (cache
    replicated from batch 1), both at `prompt_len`: which kernels the time goes to. For the Python
    lines of cache.py / attention.py behind them, sample the same run with py-spy (`--format raw`)."""
    from torch.profiler import profile

    device = next(model.parameters()).device
    policy = make_policy("h2o", budget_tokens(budget, prompt_len))
    with torch.inference_mode():
        cache = new_cache(model, policy)
        with profile() as prefill_prof:
            token, _ = prefill(model, prompt_ids(token_ids, prompt_len, 1).to(device), cache)
        cache.batch_repeat_interleave(batch)
        token = token.repeat_interleave(batch, dim=0)
        decode_steps(model, token, cache, 2)
        with profile() as decode_prof:
            decode_steps(model, token, cache, 1)
    paths = {}
    for name, prof in (("prefill", prefill_prof), ("decode", decode_prof)):
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        paths[f"profile_{name}"] = out_dir / f"profile_{name}.txt"
        paths[f"profile_{name}"].write_text(table)
    return paths


# -- command line ------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags; explicit size flags override the --size preset."""
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="model name or path (default: the bundled SmolLM2-135M)")
    add(
        "--policies",
        type=_name_list,
        default=list(POLICIES),
        help=f"comma list from {', '.join(POLICIES + EXTRA_POLICIES)} (default: {','.join(POLICIES)})",
    )
    add("--budget", type=float, default=0.2, help="cache budget as a fraction of the prompt (default 0.2)")
    add(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="preset sizes: small (CI, a few minutes on 2 CPU cores) or large (the issue's)",
    )
    add("--prompt-lens", type=_int_list, help="comma list of prompt lengths")
    add("--gen-len", type=int, help="tokens generated per sequence")
    add("--batch-sizes", type=_int_list, help="comma list of batch sizes")
    add("--repeats", type=int, help="timed runs per configuration (medians are reported)")
    add("--warmup", type=int, help="untimed runs per configuration before the timed ones")
    add("--device", default="auto", help="cpu, cuda or auto (default)")
    add("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add("--prefill-chunk", type=int, default=None, help="prefill h2o-kv caches in chunks of this many tokens")
    add(
        "--memory-cap-gb",
        type=float,
        default=None,
        help="KV-cache memory cap for the same-memory run (default: Full's measured KV at the largest batch)",
    )
    add("--out", default="results/bench", help="output directory (default results/bench)")
    add(
        "--profile",
        action="store_true",
        help="also write torch.profiler tables of an H2O prefill and decode step",
    )
    add("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` subcommand on an argparse subparsers object (runs `main` as args.func)."""
    parser = subparsers.add_parser(
        "bench", help="throughput and memory benchmark", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed flags, write the results, print the table and the bars."""
    from .models import load_model

    sizes = dict(SIZES[args.size])
    sizes.update({key: getattr(args, key) for key in sizes if getattr(args, key) is not None})
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = run_bench(
        model,
        tokenizer,
        policies=args.policies,
        budget=args.budget,
        memory_cap_gb=args.memory_cap_gb,
        prefill_chunk=args.prefill_chunk,
        progress=not args.no_progress,
        **sizes,
    )
    paths = write_results(rows, args.out)
    if args.profile:
        token_ids = tokenizer(load_text(), add_special_tokens=False)["input_ids"]
        largest = dict(prompt_len=max(sizes["prompt_lens"]), batch=max(sizes["batch_sizes"]))
        paths |= profile_h2o(model, token_ids, budget=args.budget, out_dir=Path(args.out), **largest)
    print(summary_table(rows))
    print(format_bars(check_bars(rows)))
    files = ", ".join(sorted(p.name for p in paths.values()))
    print(f"bench: {time.perf_counter() - started:.0f} s; wrote {files} to {args.out}")
    return 0


def summary_table(rows: list[Row]) -> str:
    """A compact text table of the sweep and the same-memory rows."""
    lines = [_table_line(name for name, _ in TABLE)]
    for r in rows:
        ratio = r.get("kv_bytes_ratio")
        cells = (
            r["policy"], r["prompt_len"], r["batch"], f"{r.get('prefill_s', float('nan')):.2f}",
            f"{r['decode_tok_s']:.1f}", f"{r['kv_bytes'] / 2**20:.1f}",
            "" if ratio is None else f"{ratio:.3f}", f"{r['peak_mem_delta_bytes'] / 2**20:.0f}",
            f"{r['kept_tokens']}/{r['seen_tokens']}",
        )  # fmt: skip
        lines.append(_table_line(cells) + ("  same memory" if r["section"] == "same_memory" else ""))
    return "\n".join(lines)


def _table_line(cells: Any) -> str:
    """The first cell left-aligned, the rest right-aligned, in TABLE's widths."""
    return "".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, (_, w)) in enumerate(zip(cells, TABLE)))


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m h2o_kv.bench", description=__doc__.split("\n\n")[0])
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))

"""Soak test (`h2o-kv bench --soak STEPS`): thousands of decoding steps on one bounded cache, checking
that the cache's bytes and the process's resident memory stay flat.

One prompt is prefilled into a `KVCache` (H2O at the bench's budget by default), then `steps` greedy
tokens are decoded one at a time through `h2o_kv.runtime.generation.decode_step` under
`torch.inference_mode()`. Every `every` steps it samples `cache.nbytes()`, the tokens kept and seen,
the resident set size (VmRSS from /proc/self/status; the allocator's bytes on CUDA too) and the time
per step. Verdict: nbytes is constant from the first sample where the cache is full (holding its
capacity and evicting), and the RSS grows by less than `RSS_TOLERANCE_BYTES` or `RSS_TOLERANCE_FRAC`
of itself after the warm-up (the first steps, where the allocator's caches fill, are excluded).
A policy without a capacity (`full-kv`) never counts as full, so its soak fails: it is unbounded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from h2o_kv.policies import Budget
from h2o_kv.runtime.generation import decode_step
from h2o_kv.runtime.generation import prefill as model_prefill
from h2o_kv.studies.bench.config import BASELINES, Row, new_cache, policy_for
from h2o_kv.studies.bench.memory import _proc_status_kb
from h2o_kv.studies.bench.sweep import load_text, prompt_ids
from h2o_kv.studies.bench.timing import policy_tokens, sync
from h2o_kv.studies.report import command_line, environment, pyplot, save_figure, write_csv, write_json

RSS_TOLERANCE_BYTES = 16 * 2**20  # RSS growth after the warm-up below this, or below
RSS_TOLERANCE_FRAC = 0.02  # this fraction of the RSS at the end of the warm-up, is "flat"
SAMPLE_COLUMNS = ["step", "seen_tokens", "kept_tokens", "nbytes", "rss_bytes", "cuda_bytes", "step_ms", "elapsed_s"]
FILES = dict(json="soak.json", csv="soak.csv", plot="soak.png")


def soak(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    policy: str = "h2o",
    budget: Budget = 0.2,
    steps: int = 10_000,
    every: int = 100,
    warmup: int | None = None,
    progress: bool = False,
) -> Row:
    """Prefill `input_ids` [B, n], decode `steps` greedy steps, sample memory every `every` steps.

    Returns the configuration, the samples (step 0 is right after the prefill) and the summary
    (first/last/max of nbytes and RSS, RSS growth after `warmup` steps, pass/fail of "flat").
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"soak steps must be an int >= 1, got {steps!r}")
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= steps:
        raise ValueError(f"soak every must be an int in [1, steps={steps}], got {every!r}")
    warmup = steps // 10 if warmup is None else warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
        raise ValueError(f"soak warmup must be an int in [0, steps={steps}), got {warmup!r}")
    if policy in BASELINES:
        raise ValueError(f"the soak runs an h2o-kv policy (a KVCache), not the stock {policy!r}")
    batch, prompt_len = input_ids.shape
    chosen = policy_for(policy, budget, prompt_len)
    bounded = chosen.capacity(torch.tensor([prompt_len])) is not None  # Full: no capacity, grows with the text
    capacity = policy_tokens(chosen, prompt_len) if bounded else None
    device = input_ids.device
    bar = _progress(steps) if progress else None
    samples: list[Row] = []
    with torch.inference_mode():
        cache = new_cache(model, policy, chosen, max_len=prompt_len + steps)
        started = time.perf_counter()
        token = model_prefill(model, cache, input_ids).argmax(-1)
        sync(device)
        samples.append(_sample(cache, 0, device, time.perf_counter() - started, None))
        position = torch.full_like(token, prompt_len)
        last = time.perf_counter()
        for step in range(1, steps + 1):
            token = decode_step(model, cache, token, position).argmax(-1)
            position += 1
            if step % every == 0 or step == steps:
                sync(device)
                now = time.perf_counter()
                step_ms = 1000 * (now - last) / (step - samples[-1]["step"])
                samples.append(_sample(cache, step, device, now - started, step_ms))
                last = time.perf_counter()  # sampling's own time is not a step's
                if bar is not None:
                    bar.update(step - samples[-2]["step"])
    if bar is not None:
        bar.close()
    config = dict(policy=policy, policy_desc=chosen.describe(), budget=budget, budget_tokens=capacity,
                  prompt_len=prompt_len, batch=batch, steps=steps, every=every, warmup=warmup,
                  threads=torch.get_num_threads(), device=str(device),
                  dtype=str(next(model.parameters()).dtype).removeprefix("torch."))  # fmt: skip
    return dict(config=config, summary=summarize(samples, capacity, warmup), samples=samples)


def _sample(cache, step: int, device: torch.device, elapsed: float, step_ms: float | None) -> Row:
    cuda = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    rss = _proc_status_kb("VmRSS") * 1024
    return dict(step=step, seen_tokens=cache.seen_tokens, kept_tokens=cache.kept_tokens, nbytes=cache.nbytes(),
                rss_bytes=rss, cuda_bytes=cuda, step_ms=step_ms, elapsed_s=elapsed)  # fmt: skip


def summarize(samples: list[Row], capacity: int | None, warmup: int) -> Row:
    """First/last/max of nbytes and RSS; nbytes flat once the cache is full (never, with no `capacity`);
    RSS growth after `warmup`."""
    nbytes = [s["nbytes"] for s in samples]
    # full: holding `capacity` tokens and evicting (the first eviction adds the incoming token's slot)
    full = [s["step"] for s in samples if capacity is not None and s["kept_tokens"] >= capacity < s["seen_tokens"]]
    full_at = full[0] if full else None
    after_full = [s["nbytes"] for s in samples if full_at is not None and s["step"] >= full_at]
    nbytes_flat = bool(after_full) and min(after_full) == max(after_full)
    settled = [s for s in samples if s["step"] >= warmup]
    rss = [s["rss_bytes"] for s in settled]
    base = rss[0]
    growth = max(rss) - base
    tolerance = max(RSS_TOLERANCE_BYTES, int(RSS_TOLERANCE_FRAC * base))
    rss_flat = base > 0 and growth < tolerance  # base 0: no /proc, nothing measured
    timed = [s["step_ms"] for s in samples if s["step_ms"] is not None]
    return dict(
        capacity_tokens=capacity, full_at_step=full_at, kept_tokens_max=max(s["kept_tokens"] for s in samples),
        nbytes_first=nbytes[0], nbytes_last=nbytes[-1], nbytes_max=max(nbytes), nbytes_flat=nbytes_flat,
        rss_first=samples[0]["rss_bytes"], rss_last=samples[-1]["rss_bytes"],
        rss_max=max(s["rss_bytes"] for s in samples), warmup_step=settled[0]["step"], rss_at_warmup=base,
        rss_growth_after_warmup=growth, rss_last_minus_warmup=rss[-1] - base,
        rss_slope_bytes_per_1k_steps=_slope([s["step"] for s in settled], rss) * 1000,
        rss_tolerance_bytes=tolerance, rss_flat=rss_flat, step_ms_first=timed[0] if timed else None,
        step_ms_last=timed[-1] if timed else None, passed=nbytes_flat and rss_flat,
    )  # fmt: skip


def _slope(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0


def _progress(steps: int):
    from tqdm import tqdm

    return tqdm(total=steps, desc="soak", unit="step", mininterval=5.0)


def write_soak(result: Row, out_dir: str | Path, command: str | None = None) -> dict[str, Path]:
    """soak.json (configuration, summary, samples, provenance), soak.csv (samples) and soak.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / filename for name, filename in FILES.items()}
    meta = dict(command=command or command_line(), environment=environment())
    write_json(paths["json"], dict(meta, **result))
    write_csv(paths["csv"], SAMPLE_COLUMNS, result["samples"])
    save_figure(plot_soak(result), paths["plot"])
    return paths


def plot_soak(result: Row) -> Any:
    """nbytes, RSS and ms per step against the decoding step, the warm-up and the RSS tolerance marked."""
    plt = pyplot()
    config, summary, samples = result["config"], result["summary"], result["samples"]
    steps = [s["step"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    fig.suptitle(f"Soak: {config['policy_desc']}, prompt {config['prompt_len']}, batch {config['batch']}, "
                 f"{config['steps']} steps ({'pass' if summary['passed'] else 'FAIL'})")  # fmt: skip
    axes[0].plot(steps, [s["nbytes"] / 2**20 for s in samples], marker=".")
    axes[0].set(ylabel="cache nbytes (MiB)", title=f"nbytes flat: {summary['nbytes_flat']}")
    axes[1].plot(steps, [s["rss_bytes"] / 2**20 for s in samples], marker=".", label="VmRSS")
    base, tol = summary["rss_at_warmup"] / 2**20, summary["rss_tolerance_bytes"] / 2**20
    axes[1].axhspan(base, base + tol, color="C2", alpha=0.15, label=f"tolerance ({tol:.0f} MiB)")
    growth = summary["rss_growth_after_warmup"] / 2**20
    axes[1].set(ylabel="resident memory (MiB)", title=f"RSS growth after warm-up: {growth:+.1f} MiB")
    axes[1].legend(fontsize=8)
    timed = [(s["step"], s["step_ms"]) for s in samples if s["step_ms"] is not None]
    if timed:
        axes[2].plot(*zip(*timed), marker=".")
    axes[2].set(ylabel="ms per step", xlabel="decoding step")
    for ax in axes:
        ax.axvline(summary["warmup_step"], color="grey", ls="--", lw=1)
    return fig


def format_summary(result: Row) -> str:
    config, s = result["config"], result["summary"]
    mib = 2**20
    return "\n".join([
        f"soak: {config['policy_desc']}, prompt {config['prompt_len']}, batch {config['batch']}, "
        f"{config['steps']} steps, {config['threads']} threads, {config['dtype']}",
        f"  nbytes: first {s['nbytes_first']} last {s['nbytes_last']} max {s['nbytes_max']} (full at step "
        f"{s['full_at_step']}, kept <= {s['kept_tokens_max']} of {s['capacity_tokens']}): "
        f"{'flat' if s['nbytes_flat'] else 'NOT flat'}",
        f"  RSS MiB: first {s['rss_first'] / mib:.1f} last {s['rss_last'] / mib:.1f} max {s['rss_max'] / mib:.1f}; "
        f"after step {s['warmup_step']}: growth {s['rss_growth_after_warmup'] / mib:+.1f} "
        f"(tolerance {s['rss_tolerance_bytes'] / mib:.1f}), slope {s['rss_slope_bytes_per_1k_steps'] / mib:+.2f}"
        f" per 1k steps: {'flat' if s['rss_flat'] else 'NOT flat'}",
        f"  ms per step: first {s['step_ms_first']:.1f} last {s['step_ms_last']:.1f}" if s["step_ms_first"] else "",
        f"  soak: {'PASS' if s['passed'] else 'FAIL'}",
    ]).replace("\n\n", "\n")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """`h2o-kv bench --soak STEPS`: load the model, run the soak, write the files; exit 1 when not flat."""
    from h2o_kv.runtime.models import load_model

    prompt_len = args.prompt_lens[0] if args.prompt_lens else 512
    batch = args.batch_sizes[0] if args.batch_sizes else 1
    policy = next((p for p in args.policies if p not in BASELINES), None)
    if policy is None:
        raise ValueError(f"--soak needs an h2o-kv policy in --policies, got {','.join(args.policies)}")
    policy_for(policy, args.budget, prompt_len)  # bad policy or budget: one line before loading
    if args.threads[0]:
        torch.set_num_threads(args.threads[0])
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    token_ids = tokenizer(load_text(), add_special_tokens=False)["input_ids"]
    input_ids = prompt_ids(token_ids, prompt_len, batch).to(next(model.parameters()).device)
    result = soak(model, input_ids, policy=policy, budget=args.budget, steps=args.soak, every=args.soak_every,
                  warmup=args.soak_warmup, progress=not args.no_progress)  # fmt: skip
    paths = write_soak(result, args.out)  # the CLI names a new folder when --out is not given
    print(format_summary(result))
    print(f"wrote {', '.join(sorted(p.name for p in paths.values()))} to {args.out}", file=sys.stderr)
    return 0 if result["summary"]["passed"] else 1

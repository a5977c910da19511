"""The GPU study: h2o-kv's decode and prefill on one GPU against transformers' caches, in one command.

    python -m h2o_kv.studies.bench.gpu --out DIR            # on a CUDA machine (compare/gpu/gpu_check.sh runs it)
    python -m h2o_kv.studies.bench.gpu --dry-run --out DIR  # tiny shapes on a CPU, Triton interpreted

Models have the named shapes and random weights (a step's time does not depend on the weights' values):
SmolLM2-135M (30 layers, 9 query / 3 KV heads of 64) at 4,096 tokens x batch 4, and Llama-3-8B (32 layers,
32 / 8 heads of 128) at 32,768 tokens x batch 8, in bfloat16. For each, decode tokens/s of:
`StaticCache` eager and under `torch.compile(mode="reduce-overhead", fullgraph=True)`, `DynamicCache`, and
h2o-kv's H2O and SnapKV at 20 % eager and replayed from a CUDA graph (`h2o_kv.runtime.graphs.CapturedStep`), H2O with
int8 KV, and H2O at the batch that fits in StaticCache's KV bytes; each bounded step against its bandwidth
floor (weights + cache bytes over the measured copy rate). Prefill seconds at the long context, batch 1: the
stock model (SDPA), H2O (exact scores: flash attention, then `triton_scores.key_scores`) and SnapKV.

How the long contexts are reached without prefilling every configuration: a StaticCache's decode attends over
all its preallocated slots whatever they hold, so it is prefilled with 16 tokens; a DynamicCache is filled
with random keys and values of the full length; an h2o-kv cache is prefilled with a prompt of its budget
(20 % of the context) under a token budget of that size, which leaves each (sequence, KV head) holding
exactly the tokens 20 % of the long prompt would. Positions differ; no kernel's work depends on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

from h2o_kv.studies.bench.gpu_checks import check_captured, generate_compiled
from h2o_kv.studies.bench.gpu_models import BUDGET, SHAPES, clock, copy_rate, h2o_cache, make_model, sync
from h2o_kv.studies.bench.gpu_prefill import prefill_chunked
from h2o_kv.studies.report import provenance

RUNS = {  # shape: (context, batch, decode steps)
    "smollm2-135m": (4096, 4, 64),
    "llama3-8b": (32768, 8, 32),
}
DRY = {"tiny": (160, 2, 4)}
SKIP = {
    "llama3-8b": {"h2o-compiled", "generate-compiled", "check-captured", "profile-step", "prefill-chunked"}
}  # compiling 8B twice more: minutes


def decode_loop(step, token: torch.Tensor, start: int, steps: int, warm: int, device) -> tuple[float, list]:
    """Median-free throughput timing: `warm` untimed steps, then `steps` greedy steps with one drain at the end.
    Returns (seconds per step, the greedy tokens [steps] of row 0). Tokens stay on the device between steps."""
    position = torch.full_like(token, start)
    for _ in range(warm):
        token = step(token, position).argmax(-1)
        position = position + 1
    tokens = []
    sync(device)
    begin = time.perf_counter()
    for _ in range(steps):
        token = step(token, position).argmax(-1)
        position = position + 1
        tokens.append(token[:1])
    sync(device)
    return (time.perf_counter() - begin) / steps, torch.cat(tokens).tolist()


def stock_step(model, cache, compiled: bool):
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward

    def step(token, position):
        torch.compiler.cudagraph_mark_step_begin() if compiled else None
        out = forward(input_ids=token.view(-1, 1), position_ids=position.view(-1, 1), cache_position=position[:1],
                      past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1].float()

    return step


def run_stock(model, kind: str, context: int, batch: int, steps: int, compiled: bool, device) -> dict:
    from transformers import DynamicCache, StaticCache

    model.set_attn_implementation("sdpa")
    config, dtype = model.config, next(model.parameters()).dtype
    vocab = config.vocab_size
    if kind == "static":
        cache = StaticCache(config=config, max_cache_len=context + steps + 8)
        prompt = torch.randint(vocab, (batch, 16), device=device)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = 16
    else:  # a DynamicCache of `context` random tokens per layer
        cache = DynamicCache(config=config)
        heads, dim = config.num_key_value_heads, config.head_dim
        for layer in range(config.num_hidden_layers):
            kv = torch.randn(2, batch, heads, context, dim, device=device, dtype=dtype)
            cache.update(kv[0], kv[1], layer)
        start = context
    token = torch.randint(vocab, (batch,), device=device)
    seconds, _ = decode_loop(stock_step(model, cache, compiled), token, start, steps, 3 if compiled else 2, device)
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return dict(step_ms=1000 * seconds, tok_s=batch / seconds, kv_bytes=kv)


def compiled_step(model, cache, device):
    """torch.compile(mode="reduce-overhead", fullgraph=True) over h2o-kv's decode step, after eager steps that
    bring the cache to its steady state (whose buffers are then marked static for the CUDA graphs)."""
    from h2o_kv.runtime.generation import forward

    def eager(token, position):
        return forward(model, cache, token.view(-1, 1), positions=position.view(-1, 1))

    compiled = torch.compile(eager, mode="reduce-overhead", fullgraph=True)

    def step(token, position):
        if not cache.steady:
            return eager(token, position)
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(token, position)

    return step


def run_h2o(
    model, name: str, context: int, batch: int, steps: int, how: str, device, kv_dtype=None, fraction: float = BUDGET
) -> dict:
    """Decode with an h2o-kv cache: `how` is "eager", "captured" (graphs.CapturedStep) or "compiled". `fraction`
    1.0: every slot of the context kept, the full cache's bytes on the same kernel and graph (`full-captured`)."""
    from h2o_kv.runtime.generation import forward
    from h2o_kv.runtime.graphs import CapturedStep

    budget = int(fraction * context)
    cache, _, token = h2o_cache(model, name, budget, budget, batch, device, kv_dtype)
    captured = how == "captured" and device.type == "cuda"
    if captured:
        step = CapturedStep(model, cache)
    elif how == "compiled":
        step = compiled_step(model, cache, device)
    else:

        def step(token, position):  # noqa: E306
            return forward(model, cache, token.view(-1, 1), positions=position.view(-1, 1))

    seconds, tokens = decode_loop(step, token, budget, steps, 3 if how == "eager" else 8, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(step_ms=1000 * seconds, tok_s=batch / seconds, kv_bytes=cache.nbytes(), kept=cache.kept_tokens,
                weight_bytes=weights, tokens=tokens[:8], graph=captured and step.graph is not None)  # fmt: skip


def same_memory(model, done: dict, context: int, batch: int, steps: int, device) -> dict:
    """H2O at the batch whose cache holds no more bytes than StaticCache's at `batch` (the memory it frees)."""
    per_sequence = done["h2o-captured"]["kv_bytes"] / batch
    bigger = int(done["static"]["kv_bytes"] // per_sequence)
    row = run_h2o(model, "h2o", context, bigger, steps, "captured", device)
    return dict(row, run_batch=bigger, static_kv_bytes=done["static"]["kv_bytes"])


def run_prefill(model, context: int, device, repeats: int) -> dict:
    """Prefill seconds of one sequence of `context` tokens: the stock model (SDPA, DynamicCache), H2O, SnapKV, and
    H2O read in calls of 4,096 tokens as the engine reads a prompt (`h2o-chunked`: each call's attention over the
    kept slots and itself, then eviction)."""
    from transformers import DynamicCache

    ids = torch.randint(model.config.vocab_size, (1, context), device=device)
    out = {}

    def stock():
        model.set_attn_implementation("sdpa")
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)

    for name, fn in (("sdpa", stock), ("h2o", None), ("snapkv", None), ("h2o-chunked", None)):
        times = []
        chunk = min(4096, context // 4) if name.endswith("-chunked") else None
        for _ in range(repeats + 1):
            if fn is None:
                policy = name.removesuffix("-chunked")
                times.append(h2o_cache(model, policy, int(BUDGET * context), context, 1, device, chunk=chunk)[1])
            else:
                times.append(clock(device, fn))
        out[name] = statistics.median(times[1:])
    return out


def attention_ops(context: int, shape: str, device, dtype) -> dict:
    """One layer's prompt attention at `context` tokens, batch 1: SDPA alone against flash attention with its
    log-sum-exp plus H2O's key scores (`prompt.prompt_scores`), and the decode kernel over 20 % of the slots."""
    from h2o_kv.backends import triton_decode, triton_scores

    s = SHAPES[shape]
    hq, h, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    q = torch.randn(1, hq, context, d, device=device, dtype=dtype)
    k, v = torch.randn(2, 1, h, context, d, device=device, dtype=dtype)
    pos = torch.arange(context, device=device).expand(1, h, context).contiguous()
    qpos = torch.arange(context, device=device).view(1, -1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    scale = d**-0.5

    def plain():
        sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def scored():
        flash = triton_scores.flash_with_lse(q, k, v, scaling=scale)
        lse2 = flash[1] if flash else triton_scores.row_lse(q, k, pos, qpos, scaling=scale, new_from=0)
        triton_scores.key_scores(q, k, pos, qpos, lse2, scaling=scale, new_from=0)

    res = {}
    for name, fn in (("sdpa", plain), ("sdpa+scores", scored)):
        fn()
        res[name + "_ms"] = 1000 * statistics.median(clock(device, fn) for _ in range(5))
    kept = int(BUDGET * context)
    batch = RUNS.get(shape, (0, 2, 0))[1]
    qd = torch.randn(batch, hq, 1, d, device=device, dtype=dtype)
    kd, vd = torch.randn(2, batch, h, kept, d, device=device, dtype=dtype)
    fn = lambda: triton_decode.decode_attend(qd, kd, vd, None, scaling=scale, want_scores=True)  # noqa
    fn()
    ms = 1000 * statistics.median(clock(device, fn) for _ in range(20))
    res.update(decode_kernel_ms=ms, decode_kernel_gb_s=2 * kd.numel() * kd.element_size() / ms / 1e6)
    return res


def profile_step(model, context: int, batch: int, device, steps: int = 4) -> dict:
    """Where an eager H2O step's device time goes: the kernels of `steps` steps grouped by name, the top 20 by
    total time (a graph replays the same kernels, less the launch gaps)."""
    from h2o_kv.runtime.generation import forward

    budget = int(BUDGET * context)
    cache, _, token = h2o_cache(model, "h2o", budget, budget, batch, device)
    position = torch.full_like(token, budget)
    forward(model, cache, token.view(-1, 1), positions=position.view(-1, 1))
    activities = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else None
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            forward(model, cache, token.view(-1, 1), positions=(position + 1 + i).view(-1, 1))
        sync(device)
    events = prof.key_averages()
    kernel = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = [e for e in events if e.device_type != torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]

    def top(rows, key):
        rows = sorted(rows, key=lambda e: getattr(e, key), reverse=True)[:20]
        return [
            dict(name=e.key[:90], calls_per_step=e.count / steps, us_per_step=getattr(e, key) / steps) for e in rows
        ]

    total = sum(e.device_time_total for e in kernel) / steps
    return dict(kernels=top(kernel, "device_time_total"), ops=top(ops, "self_device_time_total"),
                device_us_per_step=total, kernels_per_step=sum(e.count for e in kernel) / steps)  # fmt: skip


def study(shape: str, context: int, batch: int, steps: int, device, dtype, log, only=None) -> None:
    """Run the cells of one shape (`only`: those named), logging a row per cell."""
    model = make_model(shape, device, dtype)
    cells = [
        ("static", lambda: run_stock(model, "static", context, batch, steps, False, device)),
        ("static-compiled", lambda: run_stock(model, "static", context, batch, steps, True, device)),
        ("dynamic", lambda: run_stock(model, "dynamic", context, batch, steps, False, device)),
        ("h2o", lambda: run_h2o(model, "h2o", context, batch, steps, "eager", device)),
        ("h2o-captured", lambda: run_h2o(model, "h2o", context, batch, steps, "captured", device)),
        ("full-captured", lambda: run_h2o(model, "h2o", context, batch, steps, "captured", device, fraction=1.0)),
        ("snapkv-captured", lambda: run_h2o(model, "snapkv", context, batch, steps, "captured", device)),
        ("h2o-int8-captured", lambda: run_h2o(model, "h2o", context, batch, steps, "captured", device, "int8")),
        ("h2o-same-memory", lambda: same_memory(model, done, context, batch, steps, device)),
        ("check-captured", lambda: check_captured(model, min(context, 1024), 2, device) if device.type == "cuda"
         else {}),
        ("attention-ops", lambda: attention_ops(context, shape, device, dtype)),
        ("h2o-compiled", lambda: run_h2o(model, "h2o", context, batch, steps, "compiled", device)),
        ("generate-compiled", lambda: generate_compiled(model, device)),
        ("prefill", lambda: run_prefill(model, context, device, repeats=2)),
        ("profile-step", lambda: profile_step(model, context, batch, device)),
        ("prefill-chunked", lambda: prefill_chunked(model, context, device)),
    ]  # fmt: skip
    done: dict[str, dict] = {}
    for name, cell in cells:
        if name in SKIP.get(shape, ()) if only is None else name not in only:
            continue
        begin = time.perf_counter()
        try:
            row = done[name] = cell()
        except Exception as error:  # a failed cell is reported in the table and the log, and the study goes on
            row = dict(error=f"{type(error).__name__}: {error}"[:300])
            traceback.print_exc()
        row.update(shape=shape, cell=name, context=context, batch=batch, seconds=round(time.perf_counter() - begin, 1))
        log(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def logger(out: Path, device: torch.device):
    """(the rows so far, a function that keeps a row, prints it and appends it to out/gpu.jsonl, each with its
    `report.provenance`); on a GPU the first row names the machine and its measured copy rate."""
    rows, where = [], provenance()

    def log(row: dict) -> None:
        row = where | row  # the row's own keys win
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out / "gpu.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    if device.type == "cuda":
        log(dict(cell="machine", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                 copy_bytes_s=copy_rate(device, 1 << 32)))  # fmt: skip
    return rows, log


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    parser.add_argument("--shapes", default=",".join(RUNS), help="which of " + ", ".join(RUNS))
    parser.add_argument("--only", help="comma-separated cells to run (default: all but those skipped at a shape)")
    parser.add_argument("--report", action="store_true", help="only write DIR/tables.md from DIR/gpu.jsonl")
    args = parser.parse_args(argv)
    from h2o_kv.studies.bench.gpu_report import report

    if args.report:
        rows = [json.loads(line) for line in (args.out / "gpu.jsonl").read_text().splitlines()]
        (args.out / "tables.md").write_text(report(rows))
        print(report(rows))
        return
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("H2O_KV_TRITON") != "1":
            parser.error("a dry run needs TRITON_INTERPRET=1 H2O_KV_TRITON=1 in the environment (Triton reads it "
                         "when first imported)")  # fmt: skip
        device, dtype, runs = torch.device("cpu"), torch.float32, DRY
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        runs = {name: RUNS[name] for name in args.shapes.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    rows, log = logger(args.out, device)
    torch.set_grad_enabled(False)
    for shape, (context, batch, steps) in runs.items():
        study(shape, context, batch, steps, device, dtype, log, only=set(args.only.split(",")) if args.only else None)
    (args.out / "tables.md").write_text(report(rows))
    print(report(rows))


if __name__ == "__main__":
    main()

"""Tile sizes for the Triton kernels on this GPU, then the study's cells that depend on them, in one command.

    python -m h2o_kv.studies.bench.gpu_tune --out DIR   # compare/gpu/gpu_tune.sh runs it on a lent GPU

Times `decode_attend` (Llama-3-8B's and SmolLM2's decode shapes at 20 % of their contexts) and `key_scores`
(Llama-3-8B's prompt at 32,768 tokens) over a grid of tiles, warps, pipeline stages and programs per
multiprocessor, keeps the fastest of each, writes them to DIR/tune.json, and runs the GPU study's prefill, decode
and captured-step cells (h2o_kv/studies/bench/gpu.py) with them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import traceback
from pathlib import Path

import torch

from h2o_kv.backends import triton_decode, triton_scores
from h2o_kv.studies.bench import gpu, gpu_models

DECODE_SHAPES = {"llama3-8b": (8, 32, 8, 6553, 128), "smollm2-135m": (4, 9, 3, 819, 64)}  # B, Hq, H, slots, D
DECODE_GRID = [dict(block=b, num_warps=w, num_stages=s, per_sm=p)
               for b, w, s, p in itertools.product((64, 128), (4, 8), (2, 3), (4, 16))]  # fmt: skip
SCORE_GRID = [dict(BM=m, BN=n, num_warps=w, num_stages=s)
              for m, n, w, s in ((64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3),
                                 (64, 128, 4, 3))]  # fmt: skip


def median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tune_decode(device) -> dict:
    best = {}
    for name, (batch, hq, h, slots, dim) in DECODE_SHAPES.items():
        q = torch.randn(batch, hq, 1, dim, device=device, dtype=torch.bfloat16)
        k, v = torch.randn(2, batch, h, slots, dim, device=device, dtype=torch.bfloat16)
        nbytes = 2 * k.numel() * k.element_size()
        rows = []
        for tiles in DECODE_GRID:
            triton_decode.TILES["cuda"] = tiles
            ms = median_ms(
                lambda q=q, k=k, v=v, dim=dim: triton_decode.decode_attend(
                    q, k, v, None, scaling=dim**-0.5, want_scores=True
                )
            )
            rows.append((ms, tiles))
            print(f"decode {name} {tiles}: {ms:.4f} ms, {nbytes / ms / 1e6:.0f} GB/s", flush=True)
        ms, tiles = min(rows, key=lambda r: r[0])
        best[name] = dict(tiles=tiles, ms=ms, gb_s=nbytes / ms / 1e6)
    return best


def tune_scores(device, context: int = 32768) -> dict:
    hq, h, dim = 32, 8, 128
    q = torch.randn(1, hq, context, dim, device=device, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, h, context, dim, device=device, dtype=torch.bfloat16)
    pos = torch.arange(context, device=device).expand(1, h, context).contiguous()
    qpos = torch.arange(context, device=device).view(1, -1)
    scale = dim**-0.5
    sdpa = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                              enable_gqa=True))  # fmt: skip
    flash = median_ms(lambda: triton_scores.flash_with_lse(q, k, v, scaling=scale))
    lse2 = triton_scores.flash_with_lse(q, k, v, scaling=scale)[1]
    rows = []
    for tiles in SCORE_GRID:
        triton_scores.TILES["cuda"] = tiles
        ms = median_ms(lambda: triton_scores.key_scores(q, k, pos, qpos, lse2, scaling=scale, new_from=0))
        rows.append((ms, tiles))
        print(f"key_scores {tiles}: {ms:.3f} ms (SDPA {sdpa:.3f}, flash with lse {flash:.3f})", flush=True)
    ms, tiles = min(rows, key=lambda r: r[0])
    return dict(tiles=tiles, ms=ms, sdpa_ms=sdpa, flash_lse_ms=flash, ratio=(flash + ms) / sdpa)


def profile_prefill(out: Path, device, context: int = 32768) -> None:
    """The op table of one H2O prefill of Llama-3-8B's shapes at `context` tokens (where its time goes)."""
    model = gpu_models.make_model("llama3-8b", device, torch.bfloat16)
    gpu_models.h2o_cache(model, "h2o", int(gpu_models.BUDGET * context), context, 1, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gpu_models.h2o_cache(model, "h2o", int(gpu_models.BUDGET * context), context, 1, device)
    (out / "profile_prefill.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    del model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-sweep", action="store_true", help="the committed tiles; only the study's cells")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.set_grad_enabled(False)
    defaults = dict(triton_decode.TILES["cuda"]), dict(triton_scores.TILES["cuda"])
    decode = scores = None
    try:  # a failed sweep is printed and the study runs on the default tiles
        if not args.no_sweep:
            decode = tune_decode(device)
            scores = tune_scores(device)
    except Exception:
        traceback.print_exc()
    triton_decode.TILES["cuda"] = decode["llama3-8b"]["tiles"] if decode else defaults[0]
    triton_scores.TILES["cuda"] = scores["tiles"] if scores else defaults[1]
    (args.out / "tune.json").write_text(json.dumps(dict(decode=decode, key_scores=scores), indent=1))
    print(json.dumps(dict(decode=decode, key_scores=scores)), flush=True)
    rows, log = gpu.logger(args.out, device)
    llama = {"attention-ops", "prefill", "static", "h2o-captured"}
    if not args.no_sweep:
        llama |= {"h2o-int8-captured", "h2o-same-memory"}
    context, batch, steps = gpu.RUNS["llama3-8b"]
    gpu.study("llama3-8b", context, batch, steps, device, torch.bfloat16, log, only=llama)
    if not args.no_sweep:
        try:
            profile_prefill(args.out, device)
        except Exception:
            traceback.print_exc()
    smol = {"generate-compiled", "static-compiled", "h2o-compiled", "h2o-captured", "check-captured"}
    context, batch, steps = gpu.RUNS["smollm2-135m"]
    gpu.study("smollm2-135m", context, batch, steps, device, torch.bfloat16, log, only=smol)
    from h2o_kv.studies.bench.gpu_report import report

    (args.out / "tables.md").write_text(report(rows))
    print(report(rows))


if __name__ == "__main__":
    main()

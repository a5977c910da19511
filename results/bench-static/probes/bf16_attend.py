"""h2o-kv's attention kernel on bfloat16 tensors: bfloat16 products (what the kernel did before
`kernel.compute_dtype`) against float32 products of the same numbers (what it does now on a CPU), with
SDPA's fused kernel for scale. One layer of SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim
64), batch 4: a prompt of 1024 tokens with H2O's scores (every query's probabilities), and a decode step
over 820 kept slots. This CPU has AVX2, not AVX-512 BF16 or AMX, so bfloat16 products are emulated.

    python results/bench-static/probes/bf16_attend.py
"""
import time
from unittest import mock

import torch

from h2o_kv import kernel

B, HQ, H, N, D, KEPT = 4, 9, 3, 1024, 64, 820


def seconds(fn, repeats: int) -> float:
    fn()
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - begin) / repeats


def run(label: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, generator=gen).to(dtype) for h in (HQ, H, H))
    pos, qpos = torch.arange(N).expand(B, H, N).contiguous(), torch.arange(N).expand(B, N)
    prompt = seconds(lambda: kernel.attend(q, k, v, pos, qpos, scaling=0.125, new_from=0, want_scores=True), 2)
    q1, k1, v1 = q[:, :, :1], k[:, :, :KEPT].contiguous(), v[:, :, :KEPT].contiguous()
    work = torch.empty(2 * k1.numel())
    decode = seconds(lambda: kernel.attend(q1, k1, v1, pos[..., :KEPT], None, scaling=0.125, want_scores=True,
                                           work=work), 50)  # fmt: skip
    print(f"{label:38s} prompt {prompt:7.3f} s   decode step {decode * 1e3:7.3f} ms")


torch.manual_seed(0)
print(f"one layer, batch {B}, {torch.get_num_threads()} threads")
run("float32", torch.float32)
with mock.patch.object(kernel, "compute_dtype", lambda dtype, device: dtype):
    run("bfloat16, bfloat16 products (before)", torch.bfloat16)
run("bfloat16, float32 products (now)", torch.bfloat16)
q, k, v = (torch.randn(B, h, N, D).to(torch.bfloat16) for h in (HQ, H, H))
sdpa = seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 2)
print(f"{'SDPA bfloat16 prompt (no scores)':38s} prompt {sdpa:7.3f} s")

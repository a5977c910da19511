"""Quantized KV storage: int8 keys and values with one float32 scale per (sequence, KV head, token).

KIVI-style per-token scales (Liu et al., 2024, arXiv 2402.02750) fit eviction: a token's scale lives
in its slot, so freeing, reusing or compacting slots moves it with the token. The layer quantizes
new tokens on insert; the kernel applies the scales around its matmuls (q . k_j = s_j (q . k8_j),
sum_j p_j s_j v8_j = (p * s) @ v8), so no dequantized copy of the storage is kept.

Torch has no int8 x float product on CPU. A decode step on a CPU therefore runs `native.attend_one`,
h2o-kv's C++ kernel (csrc/attend_one.cpp, built at first use: native.py), which widens int8 to float in
registers as it reads each (sequence, KV head) row, so the step reads the 4x fewer bytes and writes no
float copy. On a GPU the Triton decode kernel reads int8 the same way (backends/triton_decode.py). Where the
C++ kernel cannot be built, or with
`KVCache(..., compile_kernel=False)`, the eager path widens one layer's int8 keys and values to float at
a time into a buffer the cache's layers share (`Settings.work`, `attend.widen`); a prompt takes the eager
path too.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per vector of the last dim: x [..., D] -> (int8 [..., D], float32 scale [...])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).div_(INT8_MAX).clamp_min_(torch.finfo(torch.float32).tiny)
    q = x.div(scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float tensor [..., D] an int8 tensor and its per-vector scales [...] stand for."""
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)

"""A prompt's attention with H2O's per-key scores at flash-attention cost, never a queries x keys matrix.

H2O scores each kept key by the attention probability it receives, summed over the prompt's queries and the
query heads of its KV group. The probabilities are exp(q.k * scale - lse) with each query row's log-sum-exp
`lse`: so the output comes from flash attention (which returns `lse` on a GPU), and `key_scores` recomputes
q.k tile by tile in a second pass, one program per tile of keys, summing exp(q.k * scale - lse) down the
queries. It never reads the values. Where no attention kernel hands out `lse` (a CPU under the interpreter,
float32), `row_lse` computes it in a pass of its own over the keys.

Visibility is the cache's (docs/eviction.md): query i at position qpos_i sees slot j when
0 <= pos_j <= qpos_i (and pos_j > qpos_i - window on a sliding layer). The new tokens sit in slots
`new_from` onwards in order, so a tile of keys skips the queries before its first new token.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# queries and keys per tile, warps, pipeline stages: a GPU's (bench/gpu_tune.py sweeps them), the interpreter's
TILES = {"cuda": dict(BM=64, BN=128, num_warps=4, num_stages=3), "cpu": dict(BM=32, BN=32, num_warps=4, num_stages=1)}
LOG2E = 1.4426950408889634


@triton.jit
def _visible(pos, qpos, i, n, WINDOW: tl.constexpr, window):
    seen = (pos[None, :] >= 0) & (pos[None, :] <= qpos[:, None]) & (i < n)[:, None]
    if WINDOW:
        seen = seen & (pos[None, :] > qpos[:, None] - window)
    return seen


@triton.jit
def _row_lse(Q, K, POS, QPOS, LSE, sqb, sqh, sqn, skb, skh, sks, spb, sph, sqpb, q_heads, n, new_from, window, scale2,
             G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bq = tl.program_id(0)
    b = bq // q_heads
    hq = bq % q_heads
    h = hq // G
    i = tl.program_id(1) * 32 + tl.arange(0, 32)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + hq * sqh + i[:, None] * sqn + d[None, :], mask=(i < n)[:, None], other=0.0)
    qpos = tl.load(QPOS + b * sqpb + i, mask=i < n, other=-1)
    m = tl.full([32], float("-inf"), tl.float32)
    total = tl.zeros([32], tl.float32)
    width = tl.minimum(new_from + tl.program_id(1) * 32 + 32, new_from + n)  # keys after the block's last query: unseen
    for j0 in range(0, width, 32):
        j = j0 + tl.arange(0, 32)
        k = tl.load(K + b * skb + h * skh + j[:, None] * sks + d[None, :], mask=(j < width)[:, None], other=0.0)
        pos = tl.load(POS + b * spb + h * sph + j, mask=j < width, other=-1)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale2
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale2
        s = tl.where(_visible(pos, qpos, i, n, WINDOW, window), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m = m_new
    lse2 = tl.where(total > 0, m + tl.log2(tl.maximum(total, 1e-30)), float("inf"))
    tl.store(LSE + bq * n + i, lse2, mask=i < n)


@triton.jit
def _key_scores(Q, K, POS, QPOS, LSE, SCORES, sqb, sqh, sqn, skb, skh, sks, spb, sph, sqpb, ssb, ssh,
                heads, n, new_from, width, score_from, window, scale2,
                G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    j0 = tl.program_id(1) * BN
    j = j0 + tl.arange(0, BN)
    d = tl.arange(0, D)
    k = tl.load(K + b * skb + h * skh + j[:, None] * sks + d[None, :], mask=(j < width)[:, None], other=0.0)
    pos = tl.load(POS + b * spb + h * sph + j, mask=j < width, other=-1)
    kbias = tl.where(pos >= 0, 0.0, float("-inf"))  # empty slots and slots past the new tokens
    first = tl.maximum(score_from, j0 - new_from)  # the first query that can see one of these keys
    # queries from `past` on see every key of the tile (old slots precede every new token; new token i sits in
    # slot new_from + i): only the tiles before it need the causal mask. A sliding window masks every tile.
    past = tl.maximum(first, j0 + BN - 1 - new_from)
    masked_end = tl.minimum(first + tl.cdiv(past - first, BM) * BM, n)
    if WINDOW:
        masked_end = n
    acc = tl.zeros([BM, BN], tl.float32)
    for g in range(G):
        base = Q + b * sqb + (h * G + g) * sqh
        lse_base = LSE + (b * heads * G + h * G + g) * n
        for i0 in range(first, masked_end, BM):
            i = i0 + tl.arange(0, BM)
            q = tl.load(base + i[:, None] * sqn + d[None, :], mask=(i < n)[:, None], other=0.0)
            lse2 = tl.load(lse_base + i, mask=i < n, other=float("inf"))  # a row past the prompt adds 0
            qpos = tl.load(QPOS + b * sqpb + i, mask=i < n, other=-1)
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            p = tl.exp2(s * scale2 + kbias[None, :] - lse2[:, None])
            acc += tl.where(_visible(pos, qpos, i, n, WINDOW, window), p, 0.0)
        for i0 in range(masked_end, n, BM):
            i = i0 + tl.arange(0, BM)
            q = tl.load(base + i[:, None] * sqn + d[None, :], mask=(i < n)[:, None], other=0.0)
            lse2 = tl.load(lse_base + i, mask=i < n, other=float("inf"))
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            acc += tl.exp2(s * scale2 + kbias[None, :] - lse2[:, None])
    tl.store(SCORES + b * ssb + h * ssh + j, tl.sum(acc, 0), mask=j < width)


def supported(q: torch.Tensor, keys: torch.Tensor) -> bool:
    dim = keys.shape[-1]
    return 16 <= dim <= 256 and dim & (dim - 1) == 0 and q.shape[1] % keys.shape[1] == 0


def _unit_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels step through the last dimension one element at a time (any other strides are passed): a copy of
    each tensor whose last stride is not 1 (a head-pooled layer's per-head views of its row, an expanded qpos)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def row_lse(q, keys, pos, qpos, *, scaling: float, new_from: int, window: int | None = None) -> torch.Tensor:
    """Each query's log-sum-exp of its visible scaled logits, in base 2 [B, Hq, n] float32 (+inf for a query that
    sees nothing). q [B, Hq, n, D], keys [B, H, S, D] (in order: the n new tokens at slots new_from...)."""
    q, keys, pos, qpos = _unit_stride(q, keys, pos, qpos)
    batch, q_heads, n, dim = q.shape
    lse = torch.empty(batch, q_heads, n, dtype=torch.float32, device=q.device)
    grid = (batch * q_heads, triton.cdiv(n, 32))
    _row_lse[grid](q, keys, pos, qpos, lse, q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                   keys.stride(2), pos.stride(0), pos.stride(1), qpos.stride(0), q_heads, n, new_from, window or 0,
                   scaling * LOG2E, G=q_heads // keys.shape[1], D=dim, WINDOW=window is not None,
                   IEEE=q.dtype == torch.float32)  # fmt: skip
    return lse


def key_scores(q, keys, pos, qpos, lse2, *, scaling: float, new_from: int, score_from: int = 0,
               window: int | None = None) -> torch.Tensor:  # fmt: skip
    """The attention each slot receives from the queries from `score_from` on, summed over them and over each
    KV group's query heads, [B, H, S] float32 (slots after the new tokens get 0). `lse2`: `row_lse`'s, base 2."""
    q, keys, pos, qpos = _unit_stride(q, keys, pos, qpos)
    batch, q_heads, n, dim = q.shape
    heads, slots = keys.shape[1], keys.shape[2]
    width = new_from + n
    scores = torch.zeros(batch, heads, slots, dtype=torch.float32, device=q.device)
    tiles = TILES["cuda" if q.device.type == "cuda" else "cpu"]
    grid = (batch * heads, triton.cdiv(width, tiles["BN"]))
    _key_scores[grid](q, keys, pos, qpos, lse2.contiguous(), scores, q.stride(0), q.stride(1), q.stride(2),
                      keys.stride(0), keys.stride(1), keys.stride(2), pos.stride(0), pos.stride(1), qpos.stride(0),
                      scores.stride(0), scores.stride(1), heads, n, new_from, width, score_from, window or 0,
                      scaling * LOG2E, G=q_heads // heads, D=dim, WINDOW=window is not None,
                      IEEE=q.dtype == torch.float32, **tiles)  # fmt: skip
    return scores


def flash_with_lse(q, keys, values, *, scaling: float, new_from: int = 0):
    """A causal prompt's or chunk's attention on a GPU with its log-sum-exp in base 2: (out [B, Hq, n, Dv],
    lse2 [B, Hq, n]), keys/values [B, H, new_from + n, D] holding the n new tokens last, in order (query i sees
    slots 0 .. new_from + i). A whole prompt (new_from 0) runs cuDNN's attention where this GPU runs it (what SDPA
    picks on Hopper), else the flash kernel; a chunk after earlier slots runs the flash kernel, whose causal mask is
    aligned to the last key (`flash_chunks` checks it once). None where neither applies (CPU, float32, head size
    over 256, a chunk where the check fails): the caller then runs SDPA and `row_lse`."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or keys.shape[-1] > 256:
        return None
    if new_from and not flash_chunks(q.device.index or 0):
        return None
    group = q.shape[1] // keys.shape[1]
    if group > 1:  # these kernels want one key head per query head
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    kernel = _cudnn if not new_from and cudnn_lse(q.device.index or 0) else _flash
    out, lse = kernel(q, keys, values, scaling)
    return out, lse[..., : q.shape[2]].reshape(q.shape[:3]) * LOG2E


def _cudnn(q, keys, values, scaling: float):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, keys, values, None, True, 0.0, True, False,
                                                              scale=scaling)[:2]  # fmt: skip


def _flash(q, keys, values, scaling: float):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True, False, scale=scaling)[:2]


def _math_check(device: int, kernel, n: int, width: int) -> bool:
    """`kernel` against the math on a small causal input of n queries over `width` keys, the queries last: the output
    and the natural log-sum-exp it should give. A capability probe, so RuntimeError means "not here"."""
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(0)
    q = torch.randn(1, 2, n, 64, device=f"cuda:{device}", generator=gen, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 2, width, 64, device=f"cuda:{device}", generator=gen, dtype=torch.bfloat16)
    try:
        out, lse = kernel(q, k, v, 0.125)
    except RuntimeError:
        return False
    logits = (q.float() @ k.float().mT) * 0.125
    seen = torch.arange(width, device=q.device) <= torch.arange(width - n, width, device=q.device)[:, None]
    logits = logits.masked_fill(~seen, float("-inf"))
    ref_out = torch.softmax(logits, -1) @ v.float()
    good_lse = torch.allclose(lse[..., :n].float().reshape(1, 2, n), logits.logsumexp(-1), atol=2e-2)
    return good_lse and torch.allclose(out.float(), ref_out, atol=3e-2)


@functools.cache
def cudnn_lse(device: int) -> bool:
    """Whether cuDNN's attention runs on this GPU and returns the output and log-sum-exp it should on a whole causal
    prompt (checked once against the math)."""
    return _math_check(device, _cudnn, 128, 128)


@functools.cache
def flash_chunks(device: int) -> bool:
    """Whether the flash kernel runs on this GPU and masks a chunk after earlier keys as the cache sees it, query i
    seeing keys 0 .. (keys - queries) + i (checked once against the math: 64 queries over 128 keys)."""
    return _math_check(device, _flash, 64, 128)

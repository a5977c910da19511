"""A decode step's attention over a layer's slots in two Triton kernels, with what the policies need.

For one new query per (sequence, query head) over the slots of its KV head, `decode_attend` returns the
attention output and, per slot, the probability summed over the query heads of the KV group (H2O, SnapKV and
AdaKV scores) and averaged over them (TOVA's `last`).
Keys and values are read once, in float, bfloat16 or int8 with per-slot scales (quant.py).

The slots are split across programs (flash decoding) so that a few sequences with long caches still fill
the GPU: the first kernel computes each split's running max, sum and weighted values, and writes the
scaled logits (one float per query head and slot, a small fraction of the bytes of the keys); the second
merges the splits into the output and the row's log-sum-exp, and turns its split's logits into
probabilities. Shapes depend only on the storage, so a steady decode step replays in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# slots per tile, warps, pipeline stages, programs per multiprocessor: a GPU's (bench/gpu_tune.py sweeps them); the
# interpreter's (smaller tiles: more of the code runs in the tests' small shapes)
TILES = {"cuda": dict(block=128, num_warps=4, num_stages=3, per_sm=4), "cpu": dict(block=32, num_warps=4, num_stages=1)}


@triton.jit
def _program(heads, split_size, slots):
    """This program's row (sequence x KV head), its sequence and KV head, and its range of slots."""
    bh = tl.program_id(0)
    start = tl.program_id(1) * split_size
    return bh, bh // heads, bh % heads, start, tl.minimum(start + split_size, slots)


@triton.jit
def _partial(Q, K, V, KS, VS, POS, LOGITS, M, L, ACC,
             sqb, sqh, skb, skh, sks, svb, svh, svs, ssb, ssh, spb, sph,
             heads, slots, split_size, scaling,
             G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, NSPLIT: tl.constexpr,
             BLOCK: tl.constexpr, HAS_POS: tl.constexpr, INT8: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, b, h, start, stop = _program(heads, split_size, slots)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    grows = g < G
    q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + d[None, :], mask=grows[:, None], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV], tl.float32)
    for s0 in range(start, stop, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        inside = s < stop
        k = tl.load(K + b * skb + h * skh + s[:, None] * sks + d[None, :], mask=inside[:, None], other=0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        logit = qk * scaling
        if INT8:
            logit = logit * tl.load(KS + b * ssb + h * ssh + s, mask=inside, other=0.0)[None, :]
        valid = inside
        if HAS_POS:
            valid = valid & (tl.load(POS + b * spb + h * sph + s, mask=inside, other=-1) >= 0)
        logit = tl.where(valid[None, :], logit, float("-inf"))
        tl.store(LOGITS + ((bh * G + g) * slots)[:, None] + s[None, :], logit, mask=grows[:, None] & inside[None, :])
        m_new = tl.maximum(m, tl.max(logit, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(logit - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + h * svh + s[:, None] * svs + dv[None, :], mask=inside[:, None], other=0)
        if INT8:
            p = p * tl.load(VS + b * ssb + h * ssh + s, mask=inside, other=0.0)[None, :]
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new
    row = (bh * NSPLIT + tl.program_id(1)) * G_PAD + g
    tl.store(M + row, m)
    tl.store(L + row, total)
    tl.store(ACC + row[:, None] * DV + dv[None, :], acc)


@triton.jit
def _merge(M, L, ACC, LOGITS, OUT, SCORE, LAST,
           sob, soh, scb, sch, slb, slh,
           heads, slots, split_size,
           G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, NSPLIT: tl.constexpr, BLOCK: tl.constexpr,
           WANT_SCORES: tl.constexpr, WANT_LAST: tl.constexpr):  # fmt: skip
    bh, b, h, start, stop = _program(heads, split_size, slots)
    g = tl.arange(0, G_PAD)
    dv = tl.arange(0, DV)
    grows = g < G
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    for i in range(NSPLIT):
        top = tl.maximum(top, tl.load(M + (bh * NSPLIT + i) * G_PAD + g))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([G_PAD], tl.float32)
    for i in range(NSPLIT):
        row = (bh * NSPLIT + i) * G_PAD + g
        total += tl.load(L + row) * tl.exp(tl.load(M + row) - top)
    if start == 0:  # the first split also merges the output
        acc = tl.zeros([G_PAD, DV], tl.float32)
        for i in range(NSPLIT):
            row = (bh * NSPLIT + i) * G_PAD + g
            acc += tl.load(ACC + row[:, None] * DV + dv[None, :]) * tl.exp(tl.load(M + row) - top)[:, None]
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(OUT + b * sob + (h * G + g)[:, None] * soh + dv[None, :], out.to(OUT.dtype.element_ty),
                 mask=grows[:, None])  # fmt: skip
    if WANT_SCORES or WANT_LAST:
        lse = tl.where(total > 0, top + tl.log(tl.maximum(total, 1e-30)), float("inf"))
        for s0 in range(start, stop, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            inside = s < stop
            logit = tl.load(LOGITS + ((bh * G + g) * slots)[:, None] + s[None, :],
                            mask=grows[:, None] & inside[None, :], other=float("-inf"))  # fmt: skip
            col = tl.sum(tl.exp(logit - lse[:, None]), 0)
            if WANT_SCORES:
                tl.store(SCORE + b * scb + h * sch + s, col, mask=inside)
            if WANT_LAST:
                tl.store(LAST + b * slb + h * slh + s, col / G, mask=inside)


def supported(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels take: power-of-two head sizes from 16 to 256, a whole KV group per head."""
    dim, dv = keys.shape[-1], values.shape[-1]
    sizes = all(16 <= x <= 256 and x & (x - 1) == 0 for x in (dim, dv))
    return sizes and q.shape[1] % keys.shape[1] == 0 and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def splits(batch_heads: int, slots: int, device: torch.device) -> int:
    """How many slot ranges each (sequence, KV head) is cut into: `per_sm` programs per multiprocessor, a power of
    two, never more than the tiles there are."""
    tiles = TILES["cuda" if device.type == "cuda" else "cpu"]
    programs = tiles["per_sm"] * sm_count(device.index) if device.type == "cuda" else 4
    want = max(1, min(-(-programs // batch_heads), -(-slots // tiles["block"]), 64))
    return 1 << (want - 1).bit_length()


@functools.cache
def sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def decode_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor | None,
    *,
    scaling: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    want_scores: bool = False,
    want_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention of q [B, Hq, 1, D] over keys/values [B, H, S, D] (`pos` [B, H, S], -1 = empty slot; None: every
    slot holds a token). Returns the output [B, 1, Hq, Dv] in q's dtype, the probabilities summed over each KV
    group [B, H, S] float32 and their mean over the group (TOVA's `last`), each None unless asked for. int8
    keys/values come with their per-slot scales [B, H, S]. A torch custom op: `torch.compile` keeps it whole,
    and a CUDA graph captures its two launches."""
    out, scores, last = torch.ops.h2o_kv.triton_decode(
        q, keys, values, pos, key_scale, value_scale, float(scaling), want_scores, want_last
    )
    return out, scores if want_scores else None, last if want_last else None


@torch.library.custom_op("h2o_kv::triton_decode", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor | None,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    scaling: float,
    want_scores: bool,
    want_last: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, q_heads, _, dim = q.shape
    heads, slots, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    group = q_heads // heads
    g_pad = max(16, 1 << (group - 1).bit_length())
    nsplit = splits(batch * heads, slots, q.device)
    tiles = TILES["cuda" if q.device.type == "cuda" else "cpu"]
    block, launch = tiles["block"], dict(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
    split_size = triton.cdiv(triton.cdiv(slots, nsplit), block) * block
    q2 = q.reshape(batch, q_heads, dim)
    f32 = dict(dtype=torch.float32, device=q.device)
    logits = torch.empty(batch * heads * group * slots, **f32)
    m = torch.empty(batch * heads * nsplit * g_pad, **f32)
    total = torch.empty_like(m)
    acc = torch.empty(batch * heads * nsplit * g_pad * dv, **f32)
    out = torch.empty(batch, q_heads, dv, dtype=q.dtype, device=q.device)
    int8 = key_scale is not None
    ks = key_scale.contiguous() if int8 else m
    vs = value_scale.contiguous() if int8 else m
    p = pos.contiguous() if pos is not None else m
    sstr = (ks.stride(0), ks.stride(1)) if int8 else (0, 0)
    pstr = (p.stride(0), p.stride(1)) if pos is not None else (0, 0)
    grid = (batch * heads, nsplit)
    ieee = q.dtype == torch.float32
    _partial[grid](q2, keys, values, ks, vs, p, logits, m, total, acc,
                   q2.stride(0), q2.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                   values.stride(0), values.stride(1), values.stride(2), *sstr, *pstr,
                   heads, slots, split_size, scaling, G=group, G_PAD=g_pad, D=dim, DV=dv, NSPLIT=nsplit,
                   BLOCK=block, HAS_POS=pos is not None, INT8=int8, IEEE=ieee, **launch)  # fmt: skip
    scores = torch.empty(batch, heads, slots if want_scores else 0, **f32)
    last = torch.empty(batch, heads, slots if want_last else 0, **f32)
    _merge[grid](m, total, acc, logits, out, scores, last, out.stride(0), out.stride(1), scores.stride(0),
                 scores.stride(1), last.stride(0), last.stride(1), heads, slots, split_size, G=group, G_PAD=g_pad,
                 DV=dv, NSPLIT=nsplit, BLOCK=block, WANT_SCORES=want_scores, WANT_LAST=want_last,
                 num_warps=4)  # fmt: skip
    return out.view(batch, 1, q_heads, dv), scores, last


@_decode_op.register_fake
def _(q, keys, values, pos, key_scale, value_scale, scaling, want_scores, want_last):
    batch, q_heads = q.shape[:2]
    heads, slots = keys.shape[1], keys.shape[2]
    out = q.new_empty(batch, 1, q_heads, values.shape[-1])
    scores = q.new_empty(batch, heads, slots if want_scores else 0, dtype=torch.float32)
    return out, scores, q.new_empty(batch, heads, slots if want_last else 0, dtype=torch.float32)


__all__ = ["decode_attend", "supported"]

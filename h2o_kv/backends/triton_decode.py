"""A decode step's attention over a layer's slots in Triton kernels, with what the policies need.

For one new query per (sequence, query head) over the slots of its KV head, `decode_attend` returns the
attention output and, per slot, the probability summed over the query heads of the KV group (H2O, SnapKV and
AdaKV scores) and averaged over them (TOVA's `last`).
Keys and values are read once, in float, bfloat16 or int8 with per-slot scales (quant.py).

The slots are split across programs (flash decoding) so that a few sequences with long caches still fill
the GPU: the first kernel computes each split's running max, sum and weighted values, and writes the
scaled logits (one float per query head and slot, a small fraction of the bytes of the keys); the second, one
short program per tile of slots, merges the splits into the output and the row's log-sum-exp, and turns its
tile's logits into probabilities.

The same two kernels, with the new token's write (WRITE) and each tile's eviction candidate (EVICT), make a full
layer's whole steady step with `triton_evict.decode_evict`'s third.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# slots per tile, warps, pipeline stages, programs per multiprocessor, slots per merge program: a GPU's
# (bench/gpu_tune.py sweeps the first four); the interpreter's (smaller tiles: more of the code runs in the tests'
# small shapes)
TILES = {"cuda": dict(block=128, num_warps=4, num_stages=3, per_sm=4, merge_block=256),
         "cpu": dict(block=32, num_warps=4, num_stages=1, merge_block=16)}  # fmt: skip


@triton.jit
def _partial(Q, K, V, KS, VS, POS, SH, LOGITS, M, L, ACC, NK, NV, VAC, NPOS, NKS, NVS,
             sqb, sqh, skb, skh, sks, svb, svh, svs, ssb, ssh, spb, sph, shb, snkb, snkh, snvb, snvh, sacb, sach,
             heads, slots, split_size, scaling,
             G: tl.constexpr, G_PAD: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
             BLOCK: tl.constexpr, HAS_POS: tl.constexpr, POOLED: tl.constexpr, INT8: tl.constexpr,
             IEEE: tl.constexpr, WRITE: tl.constexpr):  # fmt: skip
    """One split of a row's slots: running max, sum and weighted values, and the scaled logits. With WRITE, the new
    token (key NK, value NV, position NPOS; int8 with scales NKS, NVS [B * H]) goes into the row's vacant slot VAC:
    the split holding that slot stores it, and the tile holding the slot takes the new token's logit and value
    (computed once, in registers) in place of what the slot held. POOLED: the row is a head-pooled one (H = 1, every
    query head of the sequence reads it), and query head g sees only the slots whose KV head SH [B, S] is g // GROUP.
    The split count is the grid's second size, not a compile-time constant: a new batch bucket (another split count)
    reuses the compiled kernel."""
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    start = tl.program_id(1) * split_size
    stop = tl.minimum(start + split_size, slots)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    grows = g < G
    q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + d[None, :], mask=grows[:, None], other=0.0)
    if WRITE:
        vac = tl.load(VAC + b * sacb + h * sach)
        new_k = tl.load(NK + b * snkb + h * snkh + d)
        new_v = tl.load(NV + b * snvb + h * snvh + dv)
        # This launch's own store may not be visible to its loads, and patching the loaded tiles would take them
        # out of the pipelined copy (a round trip through shared memory per tile): the tiles are used as loaded,
        # and the vacant slot's logit and weighted value are the new token's, computed here and in registers.
        new_logit = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * scaling
        new_value = new_v.to(tl.float32)
        if INT8:
            new_ks, new_vs = tl.load(NKS + bh), tl.load(NVS + bh)
            new_logit, new_value = new_logit * new_ks, new_value * new_vs
        if (vac >= start) & (vac < stop):  # the one split holding the slot writes the token
            tl.store(K + b * skb + h * skh + vac * sks + d, new_k)
            tl.store(V + b * svb + h * svh + vac * svs + dv, new_v)
            tl.store(POS + b * spb + h * sph + vac, tl.load(NPOS + b))
            if INT8:
                tl.store(KS + b * ssb + h * ssh + vac, new_ks)
                tl.store(VS + b * ssb + h * ssh + vac, new_vs)
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
        if WRITE:  # the vacant slot holds the new token
            logit = tl.where((s == vac)[None, :], new_logit[:, None], logit)
        valid = inside
        if HAS_POS:
            held = tl.load(POS + b * spb + h * sph + s, mask=inside, other=-1) >= 0
            if WRITE:  # the vacant slot holds the new token
                held = held | (s == vac)
            valid = valid & held
        seen = valid[None, :]
        if POOLED:  # each query head's own KV head's slots
            slot_head = tl.load(SH + b * shb + s, mask=inside, other=-1).to(tl.int32)
            seen = seen & (slot_head[None, :] == (g // GROUP)[:, None])
        logit = tl.where(seen, logit, float("-inf"))
        tl.store(LOGITS + ((bh * G + g) * slots)[:, None] + s[None, :], logit, mask=grows[:, None] & inside[None, :])
        m_new = tl.maximum(m, tl.max(logit, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(logit - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + h * svh + s[:, None] * svs + dv[None, :], mask=inside[:, None], other=0)
        if WRITE:  # the vacant slot's row of v is stale: its weight goes to the new value instead
            on_vac = (s == vac)[None, :]
            p_vac = tl.sum(tl.where(on_vac, p, 0.0), 1)
            p = tl.where(on_vac, 0.0, p)
        if INT8:
            p = p * tl.load(VS + b * ssb + h * ssh + s, mask=inside, other=0.0)[None, :]
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        if WRITE:
            acc += p_vac[:, None] * new_value[None, :]
        m = m_new
    row = (bh * tl.num_programs(1) + tl.program_id(1)) * G_PAD + g
    tl.store(M + row, m)
    tl.store(L + row, total)
    tl.store(ACC + row[:, None] * DV + dv[None, :], acc)


NEVER = tl.constexpr(9223372036854775807)  # int64 max: a lane past the row's end never wins (imported: an object)


@triton.jit
def _oldest_lowest(prio, pos, slot):
    """The oldest of the lowest priorities among the lanes (ties: the smallest slot): (priority, position, slot)."""
    low = tl.min(prio, 0)
    oldest = tl.min(tl.where(prio == low, pos, NEVER), 0)
    return low, oldest, tl.min(tl.where((prio == low) & (pos == oldest), slot, NEVER), 0)


@triton.jit(do_not_specialize=["nsplit"])
def _merge(M, L, ACC, LOGITS, OUT, SCORE, LAST, POS, NEXT, RECENT, SINKS, CP, CPOS, CSLOT, CCOUNT, CEMPTY,
           sob, soh, scb, sch, slb, slh, spb, sph,
           heads, slots, tiles, nsplit,
           G: tl.constexpr, G_PAD: tl.constexpr, GROUP: tl.constexpr, DV: tl.constexpr,
           BLOCK: tl.constexpr, WANT_SCORES: tl.constexpr, WANT_LAST: tl.constexpr, EVICT: tl.constexpr,
           HOLES: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    """One program per row and tile of BLOCK slots (many short programs: the merge is latency-bound). Each finds
    its row's log-sum-exp from the splits' partial sums; tile 0 also merges the output. With EVICT, the tile adds
    its probabilities to the scores in place and leaves its eviction candidate (the oldest of its lowest
    priorities: the score, +inf for the protected newest positions, the sinks and, with HOLES, empty slots) for `_pick`;
    with HOLES also its count of kept tokens (CCOUNT) and its first empty slot (CEMPTY). LAST is a slot's probability
    averaged over the GROUP query heads that see it. `nsplit`, the first pass's split count, is a plain argument
    (not specialised), so a new batch bucket, which changes it, reuses the compiled kernel; its loops are unrolled
    by 8 so that the splits' loads are in flight together, as they were when the count was a constant."""
    bh = tl.program_id(0)
    b, h, tile = bh // heads, bh % heads, tl.program_id(1)
    g = tl.arange(0, G_PAD)
    dv = tl.arange(0, DV)
    grows = g < G
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    for i in tl.range(0, nsplit, loop_unroll_factor=8):
        top = tl.maximum(top, tl.load(M + (bh * nsplit + i) * G_PAD + g))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([G_PAD], tl.float32)
    for i in tl.range(0, nsplit, loop_unroll_factor=8):
        row = (bh * nsplit + i) * G_PAD + g
        total += tl.load(L + row) * tl.exp(tl.load(M + row) - top)
    if tile == 0:  # the first tile also merges the output
        acc = tl.zeros([G_PAD, DV], tl.float32)
        for i in tl.range(0, nsplit, loop_unroll_factor=8):
            row = (bh * nsplit + i) * G_PAD + g
            acc += tl.load(ACC + row[:, None] * DV + dv[None, :]) * tl.exp(tl.load(M + row) - top)[:, None]
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(OUT + b * sob + (h * G + g)[:, None] * soh + dv[None, :], out.to(OUT.dtype.element_ty),
                 mask=grows[:, None])  # fmt: skip
    if WANT_SCORES or WANT_LAST or EVICT:
        lse = tl.where(total > 0, top + tl.log(tl.maximum(total, 1e-30)), float("inf"))
        s = tile * BLOCK + tl.arange(0, BLOCK)
        inside = s < slots
        logit = tl.load(LOGITS + ((bh * G + g) * slots)[:, None] + s[None, :], mask=grows[:, None] & inside[None, :],
                        other=float("-inf"))  # fmt: skip
        col = tl.sum(tl.exp(logit - lse[:, None]), 0)
        if EVICT:
            score = tl.load(SCORE + b * scb + h * sch + s, mask=inside, other=0.0) + col
            tl.store(SCORE + b * scb + h * sch + s, score, mask=inside)
            p = tl.load(POS + b * spb + h * sph + s, mask=inside, other=NEVER)
            protected = p >= tl.load(NEXT + b) - tl.load(RECENT + b)
            if HAS_SINKS:
                protected = protected | (p < tl.load(SINKS + b))
            prio = tl.where(protected | ~inside | (p < 0), float("inf"), score)
            low, oldest, slot = _oldest_lowest(prio, p, s.to(tl.int64))
            if HOLES:  # a row within its capacity frees an empty slot instead (`_pick`)
                empty = inside & (p < 0)
                tl.store(CCOUNT + bh * tiles + tile, tl.sum((inside & ~empty).to(tl.int64), 0))
                tl.store(CEMPTY + bh * tiles + tile, tl.min(tl.where(empty, s.to(tl.int64), NEVER), 0))
            tl.store(CP + bh * tiles + tile, low)
            tl.store(CPOS + bh * tiles + tile, oldest)
            tl.store(CSLOT + bh * tiles + tile, slot)
        else:
            if WANT_SCORES:
                tl.store(SCORE + b * scb + h * sch + s, col, mask=inside)
            if WANT_LAST:
                tl.store(LAST + b * slb + h * slh + s, col / GROUP, mask=inside)


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
    slot_head: torch.Tensor | None = None,
    kv_heads: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention of q [B, Hq, 1, D] over keys/values [B, H, S, D] (`pos` [B, H, S], -1 = empty slot; None: every
    slot holds a token). Returns the output [B, 1, Hq, Dv] in q's dtype, the probabilities summed over each KV
    group [B, H, S] float32 and their mean over the group (TOVA's `last`), each None unless asked for. int8
    keys/values come with their per-slot scales [B, H, S]. A head-pooled row (pooled.py: H = 1) comes with each
    slot's KV head `slot_head` [B, 1, S] (int8) and the number of real KV heads `kv_heads`: query head i sees the
    slots of KV head i // (Hq / kv_heads), so a slot's summed probability is its own group's, and `last` the mean
    over that group. A torch custom op: `torch.compile` keeps it whole, and a CUDA graph captures its two launches."""
    out, scores, last = torch.ops.h2o_kv.triton_decode(
        q, keys, values, pos, key_scale, value_scale, slot_head, kv_heads, float(scaling), want_scores, want_last
    )
    return out, scores if want_scores else None, last if want_last else None


def _tiles(device: torch.device) -> dict:
    return TILES["cuda" if device.type == "cuda" else "cpu"]


def _partials(q, keys, values, pos, key_scale, value_scale, scaling, write=None, slot_head=None, kv_heads=1):
    """The first kernel's launch: per split, the running max, sum and weighted values, and every scaled logit.
    `write` = (new keys [B, H, 1, D], new values, vacant slots [B, H, 1], positions [B], the new int8 keys' and
    values' scales [B * H] or None, the layer's `pos`): the new token's write into the vacant slots, fused (`pos`, the
    mask, is None where every slot holds a token, else the layer's `pos`). `slot_head` [B, 1, S]: a head-pooled row's
    KV head per slot, of `kv_heads` (`decode_attend`)."""
    batch, q_heads, _, dim = q.shape
    heads, slots, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    group = q_heads // heads
    seen_by = group // kv_heads if slot_head is not None else group  # the query heads that see a slot
    g_pad = max(16, 1 << (group - 1).bit_length())
    nsplit = splits(batch * heads, slots, q.device)
    tiles = _tiles(q.device)
    block = tiles["block"]
    split_size = triton.cdiv(triton.cdiv(slots, nsplit), block) * block
    q2 = q.reshape(batch, q_heads, dim)
    f32 = dict(dtype=torch.float32, device=q.device)
    logits = torch.empty(batch * heads * group * slots, **f32)
    m = torch.empty(batch * heads * nsplit * g_pad, **f32)
    total = torch.empty_like(m)
    acc = torch.empty(batch * heads * nsplit * g_pad * dv, **f32)
    int8 = key_scale is not None
    ks = key_scale.contiguous() if int8 else m
    vs = value_scale.contiguous() if int8 else m
    p = pos.contiguous() if pos is not None else m
    sstr = (ks.stride(0), ks.stride(1)) if int8 else (0, 0)
    nk, nv, vac, npos, nks, nvs, wstr = m, m, m, m, m, m, (0,) * 6
    if write is not None:
        nk, nv, vac, npos, nks, nvs, p = write
        nks, nvs = (m, m) if nks is None else (nks, nvs)
        wstr = (nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1), vac.stride(0), vac.stride(1))
    pstr = (p.stride(0), p.stride(1)) if p is not m else (0, 0)
    sh = slot_head if slot_head is not None else m
    _partial[(batch * heads, nsplit)](
        q2, keys, values, ks, vs, p, sh, logits, m, total, acc, nk, nv, vac, npos, nks, nvs,
        q2.stride(0), q2.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), *sstr, *pstr, sh.stride(0) if sh is not m else 0, *wstr,
        heads, slots, split_size, scaling, G=group, G_PAD=g_pad, GROUP=seen_by, D=dim, DV=dv, BLOCK=block,
        HAS_POS=pos is not None, POOLED=slot_head is not None, INT8=int8, IEEE=q.dtype == torch.float32,
        WRITE=write is not None, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )  # fmt: skip
    return (m, total, acc, logits), dict(nsplit=nsplit, G=group, G_PAD=g_pad, GROUP=seen_by, DV=dv)


def _merge_grid(batch: int, heads: int, slots: int, device: torch.device) -> tuple[int, int, int]:
    block = _tiles(device)["merge_block"]
    tiles = triton.cdiv(slots, block)
    return (batch * heads, tiles), block, tiles


@torch.library.custom_op("h2o_kv::triton_decode", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor | None,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    slot_head: torch.Tensor | None,
    kv_heads: int,
    scaling: float,
    want_scores: bool,
    want_last: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, q_heads = q.shape[:2]
    heads, slots, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    if slot_head is not None and (heads != 1 or q_heads % kv_heads or slot_head.stride(-1) != 1):
        raise ValueError("a head-pooled row is one storage row (H = 1), slot_head contiguous, Hq kv_heads' multiple")
    stats, meta = _partials(q, keys, values, pos, key_scale, value_scale, scaling, slot_head=slot_head,
                            kv_heads=kv_heads)  # fmt: skip
    out = torch.empty(batch, q_heads, dv, dtype=q.dtype, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    scores = torch.empty(batch, heads, slots if want_scores else 0, **f32)
    last = torch.empty(batch, heads, slots if want_last else 0, **f32)
    grid, block, tiles = _merge_grid(batch, heads, slots, q.device)
    none = stats[0]
    _merge[grid](*stats, out, scores, last, none, none, none, none, none, none, none, none, none,
                 out.stride(0), out.stride(1), scores.stride(0), scores.stride(1), last.stride(0), last.stride(1), 0, 0,
                 heads, slots, tiles, **meta, BLOCK=block, WANT_SCORES=want_scores, WANT_LAST=want_last, EVICT=False,
                 HOLES=False, HAS_SINKS=False, num_warps=4)  # fmt: skip
    return out.view(batch, 1, q_heads, dv), scores, last


@_decode_op.register_fake
def _(q, keys, values, pos, key_scale, value_scale, slot_head, kv_heads, scaling, want_scores, want_last):
    batch, q_heads = q.shape[:2]
    heads, slots = keys.shape[1], keys.shape[2]
    out = q.new_empty(batch, 1, q_heads, values.shape[-1])
    scores = q.new_empty(batch, heads, slots if want_scores else 0, dtype=torch.float32)
    return out, scores, q.new_empty(batch, heads, slots if want_last else 0, dtype=torch.float32)


__all__ = ["decode_attend", "supported"]

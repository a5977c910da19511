"""A full layer's whole steady decode step in three Triton launches (`decode_evict`), on triton_decode.py's kernels.

For a policy that ranks by score with the newest tokens protected (H2O, SnapKV): the first kernel (`_partial`)
also writes the new token into the slot the last step freed, the second (`_merge`) adds the probabilities to the
scores in place and leaves each tile's eviction candidate, and a third (`_pick`) picks each row's victim and frees
its slot, so the step is three launches rather than a dozen small torch kernels. Shapes depend only on the
storage, so a steady decode step replays in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2o_kv.backends.triton_decode import NEVER, _merge, _merge_grid, _oldest_lowest, _partials


@triton.jit
def _pick(CP, CPOS, CSLOT, CCOUNT, CEMPTY, CAP, POS, SCORE, VACANT, spb, sph, scb, sch, svb, svh, heads, tiles,
          T_PAD: tl.constexpr, HOLES: tl.constexpr):  # fmt: skip
    """Each row's victim from its tiles' candidates (the oldest of the lowest priorities, as `Steady._evict_one`):
    its slot emptied (position -1, score 0) and kept in VACANT, where the next step writes. With HOLES, a row
    holding no more tokens than its capacity CAP [B] frees its first empty slot instead."""
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    t = tl.arange(0, T_PAD)
    inside = t < tiles
    prio = tl.load(CP + bh * tiles + t, mask=inside, other=float("inf"))
    p = tl.load(CPOS + bh * tiles + t, mask=inside, other=NEVER)
    slots = tl.load(CSLOT + bh * tiles + t, mask=inside, other=NEVER)
    _, _, slot = _oldest_lowest(prio, p, slots)
    if HOLES:
        held = tl.sum(tl.load(CCOUNT + bh * tiles + t, mask=inside, other=0), 0)
        first_empty = tl.min(tl.load(CEMPTY + bh * tiles + t, mask=inside, other=NEVER), 0)
        if (held <= tl.load(CAP + b)) & (first_empty < NEVER):
            slot = first_empty
    tl.store(POS + b * spb + h * sph + slot, -1)
    tl.store(SCORE + b * scb + h * sch + slot, 0.0)
    tl.store(VACANT + b * svb + h * svh, slot)


@torch.library.custom_op(
    "h2o_kv::triton_decode_evict", mutates_args=("keys", "values", "pos", "score", "vacant", "key_scale", "value_scale")
)
def decode_evict(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    vacant: torch.Tensor,
    next_pos: torch.Tensor,
    recent: torch.Tensor,
    scaling: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    new_pos: torch.Tensor | None = None,
    new_key_scale: torch.Tensor | None = None,
    new_value_scale: torch.Tensor | None = None,
    capacity: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A full layer's steady decode step in three launches: the attention output [B, 1, Hq, Dv], and in place the scores
    `score` [B, H, S] grown by this step's probabilities (summed over the KV group), each row's victim freed (`pos`
    -1, score 0) and its slot in `vacant` [B, H, 1]. The victim is the oldest of the row's lowest priorities, a
    priority being the score, or +inf for positions at or after `next_pos` [B, 1, 1] minus `recent` [B, 1, 1]
    (`Policy.protected_recent`: H2O, SnapKV), or below `sinks` [B, 1, 1] (`Policy.protected_sinks`). Without
    `capacity` every slot must hold a token (`Steady`'s packed layer); with each row's `capacity` (B numbers: a
    batch of different budgets) empty slots (`pos` -1) are masked, and a row holding no more than its capacity frees
    its first empty slot instead, as `Steady._evict_one`. The new token is written already, or given as `new_key` /
    `new_value` [B, H, 1, D] in the storage's dtype (int8 with `new_key_scale` / `new_value_scale` [B, H, 1]) at
    positions `new_pos` [B, 1]: the first launch then writes it into the `vacant` slots (whose scores the last
    eviction left at zero), in place of the scatters."""
    batch, q_heads = q.shape[:2]
    heads, slots, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    write = None
    if new_key is not None:
        int8 = key_scale is not None
        if new_key.dtype != keys.dtype or new_value.dtype != values.dtype or int8 != (new_key_scale is not None):
            raise ValueError("decode_evict writes a new token in the storage's dtype, int8 with its scales")
        if int8 and not (key_scale.is_contiguous() and value_scale.is_contiguous()):
            raise ValueError("decode_evict writes int8 scales in place: contiguous key_scale and value_scale")
        last_dim = lambda t: t if t.stride(-1) == 1 else t.contiguous()  # noqa: E731 (the kernel steps by 1)
        scales = [
            None if t is None else t.reshape(batch * heads).contiguous() for t in (new_key_scale, new_value_scale)
        ]
        write = (last_dim(new_key), last_dim(new_value), vacant, new_pos.reshape(batch).contiguous(), *scales, pos)
    holes = capacity is not None
    stats, meta = _partials(q, keys, values, pos if holes else None, key_scale, value_scale, scaling, write)
    out = torch.empty(batch, q_heads, dv, dtype=q.dtype, device=q.device)
    grid, block, tiles = _merge_grid(batch, heads, slots, q.device)
    cand_prio = torch.empty(batch * heads * tiles, dtype=torch.float32, device=q.device)
    cand = torch.empty(4 if holes else 2, batch * heads * tiles, dtype=torch.int64, device=q.device)
    cand_pos, cand_slot, count, empty = cand[0], cand[1], cand[-2], cand[-1]  # per tile; the last two with holes
    next_pos, recent = next_pos.reshape(batch).contiguous(), recent.expand(batch, 1, 1).reshape(batch).contiguous()
    has_sinks = sinks is not None
    sinks = sinks.expand(batch, 1, 1).reshape(batch).contiguous() if has_sinks else recent  # read only with sinks
    cap = capacity.reshape(batch).contiguous() if holes else next_pos
    _merge[grid](*stats, out, score, score, pos, next_pos, recent, sinks, cand_prio, cand_pos, cand_slot, count, empty,
                 out.stride(0), out.stride(1), score.stride(0), score.stride(1), 0, 0, pos.stride(0), pos.stride(1),
                 heads, slots, tiles, **meta, BLOCK=block, WANT_SCORES=False, WANT_LAST=False, EVICT=True,
                 HOLES=holes, HAS_SINKS=has_sinks, num_warps=4)  # fmt: skip
    _pick[(batch * heads,)](cand_prio, cand_pos, cand_slot, count, empty, cap, pos, score, vacant, pos.stride(0),
                            pos.stride(1), score.stride(0), score.stride(1), vacant.stride(0), vacant.stride(1), heads,
                            tiles, T_PAD=max(16, triton.next_power_of_2(tiles)), HOLES=holes, num_warps=1)  # fmt: skip
    return out.view(batch, 1, q_heads, dv)


@decode_evict.register_fake
def _(q, keys, values, pos, score, vacant, next_pos, recent, scaling, key_scale=None, value_scale=None, new_key=None,
      new_value=None, new_pos=None, new_key_scale=None, new_value_scale=None, capacity=None, sinks=None):  # fmt: skip
    return q.new_empty(q.shape[0], 1, q.shape[1], values.shape[-1])


__all__ = ["decode_evict"]

"""The torch attention over cache slots, pure functions of tensors: the decode step's and the blocked routes.

A call's options travel as one `Call`, the storage it reads as one `Slots`; `routes.choose` picks which route
runs a call (here, prompt.py, or a backend's kernel), `routes.attend` runs it. Every route returns what the
layer needs in one pass: the attention output, the attention each slot received (for H2O-style scores) and
the last query's attention (for TOVA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from h2o_kv.backends import native
from h2o_kv.cache.quant import dequantize

QUERY_BLOCK_ELEMENTS = 1 << 21  # a block's [heads x queries x slots] logits: 8 MiB in float32, cache-sized
#: On a GPU a block is a handful of kernel launches whatever its size: 256 MiB of float32 logits per block, so a
#: long prompt's prefill is a few large blocks per layer rather than hundreds of small ones
DEVICE_QUERY_BLOCK_ELEMENTS = 1 << 26
EMULATED = (torch.bfloat16, torch.float16)  # on a CPU without native support their products are many times slower


@dataclass(frozen=True)
class Call:
    """One attention call's options (`routes.attend`): what each query sees and what comes back beside the output.

    A query at qpos t sees slots with 0 <= pos <= t (and pos > t - `window` on sliding layers; `has_padding`: some
    qpos are -1). `new_from`: the n new tokens sit in slots new_from .. new_from + n - 1 in order, so query i sees
    no slot after new_from + i (causal blocks are skipped). `want_scores`: the attention each slot received, summed
    over the queries from index `score_from` on (SnapKV's observation window) and the group's heads; `want_last`:
    the last query's attention averaged over the group's heads. `want_out` False: the caller drops the output (a
    replay of recorded calls), so a route that computes it apart from the scores (`prompt.attend_prompt`) skips it
    and returns None; the others return it anyway."""

    scaling: float
    window: int | None = None
    softcap: float | None = None
    has_padding: bool = False
    new_from: int | None = None
    want_scores: bool = False
    want_last: bool = False
    score_from: int = 0
    want_out: bool = True


class Slots(NamedTuple):
    """The storage a call attends over: keys/values [B, H, S, D], `pos` [B, H, S] (-1 = empty; None: every slot
    holds a token), int8 storage's per-slot scales [B, H, S] (quant.py), a head-pooled row's KV head per slot
    `slot_head` [B, 1, S] and per query head `query_head` [H, G] (pooled.py), and `work`, a flat buffer a decode
    step widens int8 (or bfloat16 on a CPU) storage into (`widen`)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor | None
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    slot_head: torch.Tensor | None = None
    query_head: torch.Tensor | None = None
    work: torch.Tensor | None = None


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the kernel's products run in: float32 on a CPU that emulates bfloat16/float16 products (many
    times slower than float32 ones there), the storage's own dtype elsewhere (a GPU, or a CPU with AVX-512 BF16
    or AMX, where bfloat16 products are the faster ones)."""
    return torch.float32 if device.type == "cpu" and dtype in EMULATED and not native_products(dtype) else dtype


@functools.cache
def native_products(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` in hardware: bfloat16 with AVX-512 BF16 or AMX, float16 with AMX-FP16."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return any(
            getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        )
    return dtype == torch.float16 and getattr(cpu, "_is_amx_fp16_supported", lambda: False)()


# -- a decode step: one query per sequence that sees every kept token ------------------------------------------
def triton_one(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """Output and per-slot probabilities in one pass over the keys and values (backends/triton_decode.py); a
    head-pooled row's query heads each see their own KV head's slots."""
    from h2o_kv.backends import triton_decode  # Triton is not a dependency of the core

    pooled = kv.slot_head is not None
    return triton_decode.decode_attend(q, kv.keys, kv.values, kv.pos, scaling=call.scaling, key_scale=kv.key_scale,
                                       value_scale=kv.value_scale, want_scores=call.want_scores,
                                       want_last=call.want_last, slot_head=kv.slot_head,
                                       kv_heads=kv.query_head.shape[0] if pooled else 1)  # fmt: skip


def native_one(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """h2o-kv's C++ kernel over a row per KV head (`native.attend_one`: int8, bfloat16 or float32 storage)."""
    out, scores, last = native.attend_one(q, kv.keys, kv.values, kv.pos, scaling=call.scaling, softcap=call.softcap,
                                          key_scale=kv.key_scale, value_scale=kv.value_scale)  # fmt: skip
    return out, scores if call.want_scores else None, last if call.want_last else None


def native_pooled_one(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """h2o-kv's C++ kernel over a float32 head-pooled row (`native.pooled_attend_one`); its output stays float32."""
    out, scores, last = native.pooled_attend_one(q, kv.keys, kv.values, kv.slot_head, kv.pos, kv.query_head.shape[0],
                                                 scaling=call.scaling, softcap=call.softcap)  # fmt: skip
    return out, scores if call.want_scores else None, last if call.want_last else None


def torch_one(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """`attend_one`: torch's few kernels."""
    return attend_one(q, kv.keys, kv.values, kv.pos, scaling=call.scaling, softcap=call.softcap,
                      want_scores=call.want_scores, want_last=call.want_last, key_scale=kv.key_scale,
                      value_scale=kv.value_scale, slot_head=kv.slot_head, query_head=kv.query_head,
                      work=kv.work)  # fmt: skip


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    want_scores: bool = False,
    want_last: bool = False,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    slot_head: torch.Tensor | None = None,
    query_head: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The attention of one query per sequence that sees every kept token (a decode step): few kernels.

    Same results as the blocked path: the query's scaled logits over all slots, empty slots masked
    (`pos` None: every slot holds a token, as in a full layer's decode step, and nothing is masked),
    one fused softmax in float32, the output, and the group's probabilities summed (scores) or
    averaged (last) per slot. The output [B, 1, Hq, D] needs no transpose since n = 1.
    int8 storage: the key scales multiply the logits, the value scales the probabilities; the int8
    keys and values (and bfloat16 ones under float32 queries, `compute_dtype`) are widened into `work`
    when given (`widen`).
    """
    if key_scale is not None or keys.dtype != q.dtype:  # int8, or bfloat16 on a CPU (compute_dtype)
        keys, values = widen(keys, values, q.dtype, work)
    batch, q_heads, _, dim = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    if pos is None:  # no empty slot
        bias = None
    elif slot_head is None:
        bias = torch.where(pos < 0, float("-inf"), 0.0)[:, :, None]  # [B, H, 1, S] float32: empty slots
    else:  # head-pooled storage: [B, heads, 1, S], and each query head's logits viewed [B, heads, G', S]
        bias = pooled_bias(pos, slot_head, query_head.shape[0])
    fused = bias is not None and softcap is None and key_scale is None  # the mask rides in the matmul
    if not fused:  # no mask, or one added after the product with the key scales or the softcap
        mask = q.new_zeros(1, 1, 1)
    elif slot_head is None:  # one mask per KV head, shared by its group
        mask = bias.to(q.dtype).reshape(batch * kv_heads, -1, slots)  # a copy if `pos` is strided (a pooled prompt's)
    else:  # each query head gets its own KV head's mask, [B, Hq, S] (one small copy)
        heads = bias.shape[1]
        mask = bias.to(q.dtype).expand(batch, heads, q_heads // heads, slots).reshape(batch, q_heads, slots)
    logits = torch.baddbmm(
        mask.expand(batch * kv_heads, group, slots),
        q.reshape(batch * kv_heads, group, dim),
        keys.reshape(batch * kv_heads, slots, dim).to(q.dtype).mT,
        beta=1.0 if fused else 0.0,
        alpha=scaling,
    ).view(batch, kv_heads if bias is None else bias.shape[1], -1, slots)
    if key_scale is not None:  # int8 keys: q.k_j = s_j (q.k8_j), and the mask added in the same kernel
        scale = key_scale[:, :, None]
        if softcap is not None or bias is None:
            logits = logits.float() * scale
        else:
            logits = torch.addcmul(bias, logits.float(), scale)
    if softcap is not None:
        logits = torch.tanh(logits.float() / softcap) * softcap
        logits = logits if bias is None else logits + bias
    logits = logits.view(batch, kv_heads, group, slots)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B, H, G, S]
    weights = probs if value_scale is None else probs * value_scale[:, :, None]
    out = torch.matmul(weights.to(q.dtype), values.to(q.dtype))  # [B, H, G, D]
    scores = probs.sum(dim=2) if want_scores else None
    last = probs.mean(dim=2) if want_last else None
    if last is not None and slot_head is not None:
        last = last * query_head.shape[0]  # a mean over the group, not over every query head
    return out.view(batch, 1, q_heads, values.shape[-1]), scores, last


def widen(
    keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, work: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 keys and values as `dtype` (torch has no int8 x float product on CPU), copied into `work`, a
    flat buffer of at least both sizes reused from call to call, when given: a fresh tensor of this size
    is new memory the OS maps page by page, which costs several times the copy itself."""
    if work is None:
        return keys.to(dtype), values.to(dtype)
    k, v = keys.numel(), values.numel()
    return work[:k].view(keys.shape).copy_(keys), work[k : k + v].view(values.shape).copy_(values)


def pooled_bias(pos: torch.Tensor, slot_head: torch.Tensor, heads: int) -> torch.Tensor:
    """The additive mask of a head-pooled row, [B, heads, 1, S]: for KV head h, 0 on the kept
    slots tagged h and -inf elsewhere (query head i belongs to KV head i // group, transformers' grouping)."""
    batch, _, slots = pos.shape
    code = torch.where(pos < 0, heads, slot_head.long()).view(-1)  # an empty slot: the all -inf column
    table = torch.full((heads, heads + 1), float("-inf"), device=pos.device).fill_diagonal_(0.0)
    return table.index_select(1, code).view(heads, batch, 1, slots).transpose(0, 1).contiguous()


# -- a prompt, a chunk, or queries masked by position: blocks of queries ------------------------------------------
def stored_as(kv: Slots, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a prompt's or chunk's products read in `dtype`: one dequantized copy of int8 storage,
    shared by the query blocks, or bfloat16 storage cast for float32 products (`compute_dtype`); else the storage."""
    if kv.key_scale is not None:
        return dequantize(kv.keys, kv.key_scale, dtype), dequantize(kv.values, kv.value_scale, dtype)
    if kv.keys.dtype != dtype:
        return kv.keys.to(dtype), kv.values.to(dtype)
    return kv.keys, kv.values


def blocked(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """The general route: queries in blocks, so no [n x S] matrix is materialised; each block's logits masked by
    position (in-order new tokens without padding or window: only the old slots' holes and the causal triangle),
    an unnormalised softmax, the output and the probabilities summed per slot. The output is [B, Hq, n, D]
    transposed to [B, n, Hq, D]."""
    keys, values = stored_as(kv, q.dtype)
    pos, new_from, window, softcap = kv.pos, call.new_from, call.window, call.softcap
    batch, q_heads, n, dim = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = (q * call.scaling).view(batch, kv_heads, group, n, dim)
    elements = QUERY_BLOCK_ELEMENTS if q.device.type == "cpu" else DEVICE_QUERY_BLOCK_ELEMENTS
    block = max(1, elements // max(1, batch * q_heads * slots))
    # In-order new tokens without padding or window: only empty old slots and the causal triangle
    # of each block need masking, no [queries x slots] mask has to be built.
    in_order = new_from is not None and window is None and not call.has_padding
    old_holes = (pos[:, :, None, None, :new_from] < 0) if in_order else None
    if old_holes is not None and not bool(old_holes.any()):
        old_holes = None
    outputs = []
    scores = pos.new_zeros(pos.shape, dtype=torch.float32) if call.want_scores else None
    last = None
    for start in range(0, n, block):
        stop = min(n, start + block)
        width = slots if new_from is None else new_from + stop
        logits = torch.matmul(q[:, :, :, start:stop].reshape(batch, kv_heads, -1, dim), keys[:, :, :width].mT)
        logits = logits.view(batch, kv_heads, group, stop - start, width).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if in_order:
            if old_holes is not None:
                logits[..., :new_from].masked_fill_(old_holes, float("-inf"))
            triangle = torch.ones(stop - start, stop - start, dtype=torch.bool, device=q.device).triu_(1)
            logits[..., new_from + start :].masked_fill_(triangle, float("-inf"))
        else:
            logits.masked_fill_(hidden(kv, qpos, window, start, stop, width), float("-inf"))
        # Unnormalised softmax: exp in place, then divide the (small) outputs and score weights by
        # the row sums instead of normalising the big [queries x slots] matrix.
        row_max = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, neginf=0.0)  # padding rows: all -inf
        weights = logits.sub_(row_max).exp_().view(batch, kv_heads, -1, width)  # [B, H, G*m, S']
        inv_sum = weights.sum(dim=-1, keepdim=True).clamp_min_(1e-30).reciprocal_()  # [B, H, G*m, 1]
        out = torch.matmul(weights.to(values.dtype), values[:, :, :width]) * inv_sum.to(values.dtype)
        outputs.append(out.view(batch, q_heads, stop - start, dim))
        if scores is not None and stop > call.score_from:
            row_weight = inv_sum
            if start < call.score_from:  # queries before the observation window do not score
                row_weight = inv_sum.view(batch, kv_heads, group, stop - start, 1).clone()
                row_weight[:, :, :, : call.score_from - start] = 0
                row_weight = row_weight.view(batch, kv_heads, -1, 1)
            scores[..., :width] += torch.matmul(row_weight.mT, weights).squeeze(-2)
        if call.want_last and stop == n:
            rows = weights.view(batch, kv_heads, group, stop - start, width)[:, :, :, -1]
            probs_last = rows * inv_sum.view(batch, kv_heads, group, stop - start, 1)[:, :, :, -1]
            last = torch.zeros_like(pos, dtype=torch.float32)
            last[..., :width] = probs_last.mean(dim=2) * (1 if kv.slot_head is None else kv.query_head.shape[0])
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), scores, last


def hidden(kv: Slots, qpos: torch.Tensor, window: int | None, start: int, stop: int, width: int) -> torch.Tensor:
    """Which of the first `width` slots the queries start..stop do not see, [B, H, G, m, S'] broadcast: empty ones,
    positions after the query's, those out of the `window`, and in a head-pooled row another KV head's."""
    block_pos = kv.pos[:, :, None, None, :width]  # [B, H, 1, 1, S']
    t = qpos[:, None, None, start:stop, None]  # [B, 1, 1, m, 1]
    hide = (block_pos < 0) | (block_pos > t)
    if window is not None:
        hide = hide | (block_pos <= t - window)
    if kv.slot_head is not None:  # [B, 1, Hq, 1, S']: another head's slot
        hide = hide | (kv.slot_head[:, :, None, None, :width] != kv.query_head.view(1, 1, -1, 1, 1))
    return hide

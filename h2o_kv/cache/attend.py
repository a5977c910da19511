"""The attention kernel over cache slots: a pure function of tensors, no state.

It computes what the layer needs in one pass: the attention output, the attention each slot
received (for H2O-style scores) and the last query's attention (for TOVA).
"""

from __future__ import annotations

import functools

import torch

from h2o_kv.backends import native, use_triton
from h2o_kv.cache.quant import dequantize

QUERY_BLOCK_ELEMENTS = 1 << 21  # a block's [heads x queries x slots] logits: 8 MiB in float32, cache-sized
#: On a GPU a block is a handful of kernel launches whatever its size: 256 MiB of float32 logits per block, so a
#: long prompt's prefill is a few large blocks per layer rather than hundreds of small ones
DEVICE_QUERY_BLOCK_ELEMENTS = 1 << 26
EMULATED = (torch.bfloat16, torch.float16)  # on a CPU without native support their products are many times slower


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the kernel's products run in: float32 on a CPU that emulates bfloat16/float16 products (many
    times slower than float32 ones there), the storage's own dtype elsewhere (a GPU, or a CPU with AVX-512 BF16
    or AMX, where bfloat16 products are the faster ones)."""
    return torch.float32 if device.type == "cpu" and dtype in EMULATED and not native_products(dtype) else dtype


def native_rows(keys: torch.Tensor, compute: torch.dtype) -> bool:
    """Whether `native.attend_one` reads this storage for a decode step computed in `compute`: int8 or bfloat16
    (widened in registers, float32 products), or float32 products over float32 storage."""
    return keys.dtype in (torch.int8, torch.bfloat16) or keys.dtype == compute == torch.float32


@functools.cache
def native_products(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` in hardware: bfloat16 with AVX-512 BF16 or AMX, float16 with AMX-FP16."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return any(
            getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        )
    return dtype == torch.float16 and getattr(cpu, "_is_amx_fp16_supported", lambda: False)()


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    qpos: torch.Tensor,
    *,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    has_padding: bool = False,
    new_from: int | None = None,
    want_scores: bool = False,
    want_last: bool = False,
    score_from: int = 0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    slot_head: torch.Tensor | None = None,
    query_head: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    native_kernels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention of new queries over cache slots, per KV head, returning what the policies need.

    q [B, Hq, n, D]; keys/values [B, H, S, D]; pos [B, H, S] slot positions (-1 = empty);
    qpos [B, n] query positions (-1 = padding; pass has_padding=True then). A query at t sees
    slots with 0 <= pos <= t (and pos > t - window on sliding layers). When the n new tokens sit
    in slots new_from .. new_from + n - 1 in order, query i can only see slots before
    new_from + i + 1, so later slots are skipped (causal blocks are not computed).
    Returns the output [B, n, Hq, D], the attention each slot received summed over queries and
    the group's heads [B, H, S] (float32; only queries from index `score_from` on count: SnapKV's
    observation window), and the attention from the last query averaged over
    the group's heads [B, H, S]. Queries go in blocks so no [n x S] matrix is materialised.
    int8 keys/values come with their per-slot scales `key_scale`/`value_scale` [B, H, S] (quant.py);
    a decode step widens them into `work` when given (`widen`). With `native_kernels`, a decode step over int8,
    bfloat16 or float32 storage (`native_rows`: one row per KV head) or over a float32 head-pooled row runs h2o-kv's
    C++ kernel instead (native.py), and so does a float32 prompt or chunk of in-order new tokens on a CPU without
    window or softcap that no SDPA path takes (`native.prompt_attend`: H2O's scores). bfloat16/float16 on a CPU
    computes in float32 (`compute_dtype`) and returns the output in the query's dtype.
    A head-pooled layer (one storage row shared by the KV heads, pooled.py) gives each slot's KV head
    `slot_head` [B, 1, S] and each query head's KV head `query_head` [H, G] (h for row h): a query sees only its own
    head's slots, so the scores summed over the "group" (every query head) count the slot's own group.
    """
    dtype = q.dtype  # bfloat16 on a CPU: float32 products (compute_dtype), the output cast back at each return
    q = q.to(compute_dtype(dtype, q.device))
    batch, q_heads, n, dim = q.shape
    triton = softcap is None and slot_head is None and use_triton(q.device)
    if triton:  # imported here: Triton is not a dependency of the core
        from h2o_kv.backends import triton_decode, triton_scores
    if triton and n == 1 and window is None and not has_padding and triton_decode.supported(q, keys, values):
        out, scores, last = triton_decode.decode_attend(q, keys, values, pos, scaling=scaling, key_scale=key_scale,
                                                        value_scale=value_scale, want_scores=want_scores,
                                                        want_last=want_last)  # fmt: skip
        return out.to(dtype), scores, last
    if n == 1 and window is None and not has_padding:
        if native_kernels and slot_head is None and native_rows(keys, q.dtype):
            out, scores, last = native.attend_one(q, keys, values, pos, scaling=scaling, softcap=softcap,
                                                  key_scale=key_scale, value_scale=value_scale)  # fmt: skip
            return out.to(dtype), scores if want_scores else None, last if want_last else None
        if native_kernels and slot_head is not None and keys.dtype == q.dtype == torch.float32:
            out, scores, last = native.pooled_attend_one(q, keys, values, slot_head, pos, query_head.shape[0],
                                                         scaling=scaling, softcap=softcap)  # fmt: skip
            return out, scores if want_scores else None, last if want_last else None
        out, scores, last = attend_one(q, keys, values, pos, scaling=scaling, softcap=softcap, want_scores=want_scores,
                                       want_last=want_last, key_scale=key_scale, value_scale=value_scale,
                                       slot_head=slot_head, query_head=query_head, work=work)  # fmt: skip
        return out.to(dtype), scores, last
    if key_scale is not None:  # a prompt or chunk: one dequantized copy, shared by the query blocks
        keys, values = dequantize(keys, key_scale, q.dtype), dequantize(values, value_scale, q.dtype)
    elif keys.dtype != q.dtype:  # bfloat16 storage, float32 products (compute_dtype)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    fused = new_from is not None and softcap is None and slot_head is None and not has_padding
    fused = fused and (window is None or new_from == 0) and n > 1
    if fused and (new_from == 0 or not bool((pos[..., :new_from] < 0).any())):  # in order after no holes
        if triton and (want_scores or want_last) and triton_scores.supported(q, keys):
            out, scores, last = prompt_scores(q, keys, values, pos, qpos, scaling=scaling, new_from=new_from,
                                              window=window, want_scores=want_scores, want_last=want_last,
                                              score_from=score_from)  # fmt: skip
            return out.to(dtype), scores, last
        if not want_scores or 0 < score_from < n:
            out, scores, last = attend_prompt(q, keys, values, pos, qpos, scaling=scaling, new_from=new_from,
                                              window=window, want_scores=want_scores, want_last=want_last,
                                              score_from=score_from)  # fmt: skip
            return out.to(dtype), scores, last
    native_prompt = native_kernels and new_from is not None and window is None and softcap is None and n > 1
    if native_prompt and slot_head is None and q.device.type == "cpu" and q.dtype == keys.dtype == torch.float32:
        # a prompt's or chunk's probabilities summed per slot (H2O): tiles of queries in C++ (native.prompt_attend)
        out, scores, last = native.prompt_attend(q, keys, values, pos, qpos, has_padding=has_padding,
                                                 new_from=new_from, scaling=scaling, want_scores=want_scores,
                                                 score_from=score_from, want_last=want_last)  # fmt: skip
        return out.to(dtype), scores, last
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = (q * scaling).view(batch, kv_heads, group, n, dim)
    elements = QUERY_BLOCK_ELEMENTS if q.device.type == "cpu" else DEVICE_QUERY_BLOCK_ELEMENTS
    block = max(1, elements // max(1, batch * q_heads * slots))
    # In-order new tokens without padding or window: only empty old slots and the causal triangle
    # of each block need masking, no [queries x slots] mask has to be built.
    in_order = new_from is not None and window is None and not has_padding
    old_holes = (pos[:, :, None, None, :new_from] < 0) if in_order else None
    if old_holes is not None and not bool(old_holes.any()):
        old_holes = None
    outputs = []
    scores = pos.new_zeros(pos.shape, dtype=torch.float32) if want_scores else None
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
            block_pos = pos[:, :, None, None, :width]  # [B, H, 1, 1, S']
            if n == 1 and window is None and not has_padding:
                hidden = block_pos < 0  # decoding: every kept token precedes the query
            else:
                t = qpos[:, None, None, start:stop, None]  # [B, 1, 1, m, 1]
                hidden = (block_pos < 0) | (block_pos > t)
                if window is not None:
                    hidden = hidden | (block_pos <= t - window)
            if slot_head is not None:  # [B, 1, Hq, 1, S']: another head's slot
                hidden = hidden | (slot_head[:, :, None, None, :width] != query_head.view(1, 1, -1, 1, 1))
            logits.masked_fill_(hidden, float("-inf"))
        # Unnormalised softmax: exp in place, then divide the (small) outputs and score weights by
        # the row sums instead of normalising the big [queries x slots] matrix.
        row_max = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, neginf=0.0)  # padding rows: all -inf
        weights = logits.sub_(row_max).exp_().view(batch, kv_heads, -1, width)  # [B, H, G*m, S']
        inv_sum = weights.sum(dim=-1, keepdim=True).clamp_min_(1e-30).reciprocal_()  # [B, H, G*m, 1]
        out = torch.matmul(weights.to(values.dtype), values[:, :, :width]) * inv_sum.to(values.dtype)
        outputs.append(out.view(batch, q_heads, stop - start, dim))
        if scores is not None and stop > score_from:
            row_weight = inv_sum
            if start < score_from:  # queries before the observation window do not score
                row_weight = inv_sum.view(batch, kv_heads, group, stop - start, 1).clone()
                row_weight[:, :, :, : score_from - start] = 0
                row_weight = row_weight.view(batch, kv_heads, -1, 1)
            scores[..., :width] += torch.matmul(row_weight.mT, weights).squeeze(-2)
        if want_last and stop == n:
            rows = weights.view(batch, kv_heads, group, stop - start, width)[:, :, :, -1]
            probs_last = rows * inv_sum.view(batch, kv_heads, group, stop - start, 1)[:, :, :, -1]
            last = torch.zeros_like(pos, dtype=torch.float32)
            last[..., :width] = probs_last.mean(dim=2) * (1 if slot_head is None else query_head.shape[0])
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous().to(dtype), scores, last


def attend_prompt(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, qpos: torch.Tensor, *,
                  scaling: float, new_from: int, window: int | None, want_scores: bool, want_last: bool,
                  score_from: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """`attend` for in-order new tokens after old slots without holes, when no query before `score_from`
    needs its attention probabilities (SnapKV's observation window, TOVA's last query, or no scores).

    The output is torch's fused causal attention (SDPA), which never materialises the probabilities;
    the queries that score (from `score_from` on, or the last one for `want_last`) go through `attend`
    again for their scores, a small call. Query i sees slots 0 .. new_from + i, as in `attend`; on a
    sliding layer (a whole prompt, new_from = 0, where slot j holds position j) only the last `window`.
    """
    n, width = q.shape[2], new_from + q.shape[2]
    keys, values = keys[:, :, :width], values[:, :, :width]
    rows, cols = torch.arange(new_from, width, device=q.device)[:, None], torch.arange(width, device=q.device)
    if window is not None:  # a whole prompt on a sliding layer: query i sees slots i - window < j <= i
        seen = (cols <= rows) & (cols > rows - window)
    else:  # every old slot, and the new tokens up to itself (new_from = 0: SDPA's own causal mask)
        seen = None if new_from == 0 else cols <= rows
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(q, keys, values, attn_mask=seen, is_causal=seen is None, scale=scaling, enable_gqa=True)
    scores = last = None
    if want_scores or want_last:
        start = score_from if want_scores else n - 1
        _, scores, last = attend(q[:, :, start:], keys, values, pos[..., :width], qpos[:, start:], scaling=scaling,
                                 window=window, new_from=new_from + start, want_scores=want_scores,
                                 want_last=want_last)  # fmt: skip
        if pos.shape[-1] > width:  # slots after the new tokens (storage reserved ahead) got no attention
            scores = None if scores is None else torch.nn.functional.pad(scores, (0, pos.shape[-1] - width))
            last = None if last is None else torch.nn.functional.pad(last, (0, pos.shape[-1] - width))
    return out.transpose(1, 2).contiguous(), scores, last


def prompt_scores(q, keys, values, pos, qpos, *, scaling: float, new_from: int, window: int | None,
                  want_scores: bool, want_last: bool, score_from: int):  # fmt: skip
    """`attend` for in-order new tokens through the Triton kernels (backends/triton_scores.py): the output from
    flash attention, or SDPA, the probabilities from a second pass over the keys with each query's log-sum-exp."""
    n, width = q.shape[2], new_from + q.shape[2]
    from h2o_kv.backends import triton_scores

    flash = None
    if new_from == 0 and window is None:
        flash = triton_scores.flash_with_lse(q, keys[:, :, :n], values[:, :, :n], scaling=scaling)
    if flash is not None:
        out, lse2 = flash
        out = out.transpose(1, 2).contiguous()
    else:
        out = attend_prompt(q, keys, values, pos, qpos, scaling=scaling, new_from=new_from, window=window,
                            want_scores=False, want_last=False, score_from=0)[0]  # fmt: skip
        lse2 = triton_scores.row_lse(q, keys, pos, qpos, scaling=scaling, new_from=new_from, window=window)
    pos = pos.contiguous()
    scores = last = None
    if want_scores:
        scores = triton_scores.key_scores(q, keys, pos, qpos, lse2, scaling=scaling, new_from=new_from,
                                          score_from=score_from, window=window)  # fmt: skip
    if want_last:  # the last query's probabilities, averaged over the group (0 past the new tokens, as above)
        last = triton_scores.key_scores(q[:, :, -1:], keys, pos, qpos[:, -1:], lse2[:, :, -1:], scaling=scaling,
                                        new_from=width - 1, window=window)  # fmt: skip
        last = last / (q.shape[1] // keys.shape[1])
    return out.to(q.dtype), scores, last


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
    """`attend` for one query per sequence that sees every kept token (a decode step): few kernels.

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

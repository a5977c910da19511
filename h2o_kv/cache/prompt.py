"""The routes of a prompt or chunk (`routes.choose`): new tokens in order after old slots without holes.

Where no query before `score_from` needs its probabilities (SnapKV's observation window, TOVA's last query, or no
scores), the output comes from an attention that never materialises them (torch's SDPA, or flash attention on the
Triton kernels) and the probabilities the policy needs from a second, smaller pass. A float32 prompt on a CPU
that needs every query's (H2O) runs h2o-kv's C++ kernel instead of the blocked route.
"""

from __future__ import annotations

import torch

from h2o_kv.backends import native
from h2o_kv.cache.attend import Call, Slots, blocked, stored_as, torch_one


def attend_prompt(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """The output from SDPA (None without `want_out`); the queries that score (from `score_from` on, or the last one
    for `want_last`) then take a small call of their own over the same slots: `torch_one` for one query that sees
    every kept token, the blocked route otherwise. Slots after the new tokens (storage reserved ahead) get no
    attention."""
    keys, values = stored_as(kv, q.dtype)
    n, width = q.shape[2], call.new_from + q.shape[2]
    keys, values = keys[:, :, :width], values[:, :, :width]
    out = sdpa(q, keys, values, call).transpose(1, 2).contiguous() if call.want_out else None
    scores = last = None
    if call.want_scores or call.want_last:
        start = call.score_from if call.want_scores else n - 1
        scoring = Call(call.scaling, window=call.window, new_from=call.new_from + start, want_scores=call.want_scores,
                       want_last=call.want_last)  # fmt: skip
        # never a backend's kernel: where the Triton kernels run they took the whole call (`prompt_scores`) unless
        # its head size or grouping is one they do not take at all, and the C++ ones are not asked for this part
        route = torch_one if n - start == 1 and call.window is None else blocked
        _, scores, last = route(q[:, :, start:], Slots(keys, values, kv.pos[..., :width]), qpos[:, start:], scoring)
        if kv.pos.shape[-1] > width:
            scores = None if scores is None else torch.nn.functional.pad(scores, (0, kv.pos.shape[-1] - width))
            last = None if last is None else torch.nn.functional.pad(last, (0, kv.pos.shape[-1] - width))
    return out, scores, last


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: Call) -> torch.Tensor:
    """torch's fused attention [B, Hq, n, D] of the n new tokens over keys/values [B, H, new_from + n, D]: query i
    sees slots 0 .. new_from + i, as in the blocked route; on a sliding layer (a whole prompt, new_from = 0, where
    slot j holds position j) only the last `window`."""
    new_from, window, width = call.new_from, call.window, call.new_from + q.shape[2]
    rows, cols = torch.arange(new_from, width, device=q.device)[:, None], torch.arange(width, device=q.device)
    if window is not None:  # a whole prompt on a sliding layer: query i sees slots i - window < j <= i
        seen = (cols <= rows) & (cols > rows - window)
    else:  # every old slot, and the new tokens up to itself (new_from = 0: SDPA's own causal mask)
        seen = None if new_from == 0 else cols <= rows
    attention = torch.nn.functional.scaled_dot_product_attention
    return attention(q, keys, values, attn_mask=seen, is_causal=seen is None, scale=call.scaling, enable_gqa=True)


def prompt_scores(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """On the Triton kernels (backends/triton_scores.py): the output and each query's log-sum-exp from flash
    attention (a whole prompt, or a chunk after earlier slots), else from SDPA and a pass of `row_lse`; the
    probabilities from a second pass over the keys with them."""
    from h2o_kv.backends import triton_scores  # Triton is not a dependency of the core

    keys, values = stored_as(kv, q.dtype)
    width = call.new_from + q.shape[2]
    scaling, new_from, window = call.scaling, call.new_from, call.window
    flash = None
    if window is None:
        flash = triton_scores.flash_with_lse(q, keys[:, :, :width], values[:, :, :width], scaling=scaling,
                                             new_from=new_from)  # fmt: skip
    if flash is not None:
        out, lse2 = flash
        out = out.transpose(1, 2).contiguous()
    else:
        out = sdpa(q, keys[:, :, :width], values[:, :, :width], call).transpose(1, 2).contiguous()
        lse2 = triton_scores.row_lse(q, keys, kv.pos, qpos, scaling=scaling, new_from=new_from, window=window)
    pos = kv.pos.contiguous()
    scores = last = None
    if call.want_scores:
        scores = triton_scores.key_scores(q, keys, pos, qpos, lse2, scaling=scaling, new_from=new_from,
                                          score_from=call.score_from, window=window)  # fmt: skip
    if call.want_last:  # the last query's probabilities, averaged over the group (0 past the new tokens, as above)
        last = triton_scores.key_scores(q[:, :, -1:], keys, pos, qpos[:, -1:], lse2[:, :, -1:], scaling=scaling,
                                        new_from=width - 1, window=window)  # fmt: skip
        last = last / (q.shape[1] // keys.shape[1])
    return out.to(q.dtype), scores, last


def native_prompt(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call):
    """h2o-kv's C++ kernel (`native.prompt_attend`): a float32 prompt's or chunk's probabilities summed per slot
    (H2O's scores), tiles of queries per (sequence, KV head)."""
    keys, values = stored_as(kv, q.dtype)
    return native.prompt_attend(q, keys, values, kv.pos, qpos, has_padding=call.has_padding, new_from=call.new_from,
                                scaling=call.scaling, want_scores=call.want_scores, score_from=call.score_from,
                                want_last=call.want_last)  # fmt: skip

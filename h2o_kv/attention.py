"""How attention scores are gathered: the attention function h2o-kv registers with transformers.

`enable(model)` switches a model to the "h2o_kv" attention implementation through transformers'
`AttentionInterface`. When the model runs with an `h2o_kv.KVCache`, each layer's attention is
computed by the cache layer (which needs the probabilities to score tokens and evict). Without
one, it falls back to stock SDPA, so an enabled model still works with any other cache.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from .cache import KVLayer

IMPLEMENTATION = "h2o_kv"
QUERY_BLOCK_ELEMENTS = 1 << 21  # a block's [heads x queries x slots] logits: 8 MiB in float32, cache-sized

_pending = threading.local()


def set_pending(layer: KVLayer | None) -> KVLayer | None:
    """Hand the layer whose keys were just cached to the attention call that follows; return the previous."""
    previous = getattr(_pending, "layer", None)
    _pending.layer = layer
    return previous


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention of new queries over cache slots, per KV head, returning what the policies need.

    q [B, Hq, n, D]; keys/values [B, H, S, D]; pos [B, H, S] slot positions (-1 = empty);
    qpos [B, n] query positions (-1 = padding; pass has_padding=True then). A query at t sees
    slots with 0 <= pos <= t (and pos > t - window on sliding layers). When the n new tokens sit
    in slots new_from .. new_from + n - 1 in order, query i can only see slots before
    new_from + i + 1, so later slots are skipped (causal blocks are not computed).
    Returns the output [B, n, Hq, D], the attention each slot received summed over queries and
    the group's heads [B, H, S] (float32), and the attention from the last query averaged over
    the group's heads [B, H, S]. Queries go in blocks so no [n x S] matrix is materialised.
    """
    batch, q_heads, n, dim = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = (q * scaling).view(batch, kv_heads, group, n, dim)
    block = max(1, QUERY_BLOCK_ELEMENTS // max(1, batch * q_heads * slots))
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
            logits.masked_fill_(hidden, float("-inf"))
        # Unnormalised softmax: exp in place, then divide the (small) outputs and score weights by
        # the row sums instead of normalising the big [queries x slots] matrix.
        row_max = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, neginf=0.0)  # padding rows: all -inf
        weights = logits.sub_(row_max).exp_().view(batch, kv_heads, -1, width)  # [B, H, G*m, S']
        inv_sum = weights.sum(dim=-1, keepdim=True).clamp_min_(1e-30).reciprocal_()  # [B, H, G*m, 1]
        out = torch.matmul(weights.to(values.dtype), values[:, :, :width]) * inv_sum.to(values.dtype)
        outputs.append(out.view(batch, q_heads, stop - start, dim))
        if scores is not None:
            scores[..., :width] += torch.matmul(inv_sum.mT, weights).squeeze(-2)
        if want_last and stop == n:
            rows = weights.view(batch, kv_heads, group, stop - start, width)[:, :, :, -1]
            probs_last = rows * inv_sum.view(batch, kv_heads, group, stop - start, 1)[:, :, :, -1]
            last = torch.zeros_like(pos, dtype=torch.float32)
            last[..., :width] = probs_last.mean(dim=2)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), scores, last


def h2o_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: route to the cache layer, or to SDPA without one."""
    layer = set_pending(None)
    if layer is None or layer.pending is None or layer.pending[0] is not key:
        # these keys did not come from a KVCache update: another cache (or none) is in use
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = layer.forward_attention(
        query,
        attention_mask,
        scaling=scaling,
        window=kwargs.get("sliding_window") or getattr(module, "sliding_window", None),
        softcap=kwargs.get("softcap"),
    )
    return out, None


def _materialised_mask(*args, **kwargs):
    """SDPA's boolean mask, always built: the cache reads padding from its diagonal."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(IMPLEMENTATION, h2o_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _materialised_mask)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Switch `model` to h2o-kv attention (needed for `KVCache` to see attention scores).

    Raises ValueError, leaving the model unchanged, for architectures whose attention does not go
    through transformers' AttentionInterface or that keep state other than keys and values.
    """
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; h2o-kv supports decoder-only causal LMs")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{name} does not route attention through transformers' AttentionInterface, "
            "so h2o-kv cannot gather attention scores for it"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    unsupported = layer_types - {"full_attention", "sliding_attention"}
    if unsupported:
        raise ValueError(
            f"{name} has layers of type {sorted(unsupported)}; h2o-kv evicts from key/value caches "
            "of attention layers only"
        )
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(IMPLEMENTATION)
    else:
        config._attn_implementation = IMPLEMENTATION
    return model


def is_enabled(model: PreTrainedModel) -> bool:
    return getattr(model.config, "_attn_implementation", None) == IMPLEMENTATION

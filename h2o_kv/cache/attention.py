"""How attention reaches the cache: the attention function h2o-kv registers with transformers.

`enable(model)` switches a model to the "h2o_kv" implementation through transformers'
`AttentionInterface`. A model calls its cache's `update(keys, values)` and then its attention
function; a `KVCache` layer needs the queries too (it scores tokens with the attention
probabilities), so the two calls are joined here: `hand_off` (called by `KVCache.update`) leaves
the layer for the `h2o_attention` call that follows on the same thread, which checks that the
keys it gets are the ones that layer just received. Without a KVCache, attention is stock SDPA,
so an enabled model still works with any other cache.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from h2o_kv.model_config import text_config

IMPLEMENTATION = "h2o_kv"

_pending = threading.local()


def hand_off(layer: Any, keys: torch.Tensor) -> tuple[Any, torch.Tensor] | None:
    """Leave `layer` (whose keys were just cached) for the next attention call; return what was left before."""
    previous = getattr(_pending, "item", None)
    _pending.item = None if layer is None else (layer, keys)
    return previous


def mark_forward(batch: int, length: int) -> None:
    """Note that an h2o-kv-enabled model is starting a forward call over `length` new tokens (its mask is built)."""
    _pending.forward = (batch, length)


def take_forward_mark() -> tuple[int, int] | None:
    """The (batch, new tokens) of the enabled forward call now running on this thread, if any; clears it."""
    mark = getattr(_pending, "forward", None)
    _pending.forward = None
    return mark


def _take(keys: torch.Tensor) -> Any | None:
    """The layer handed off for exactly these keys, or None (another cache, or none, is in use)."""
    item = getattr(_pending, "item", None)
    _pending.item = None
    if item is None or item[1] is not keys:
        return None
    return item[0]


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
    layer = _take(key)
    if layer is None:  # these keys did not come from a KVCache update
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("output_attentions"):
        layer.pending = None
        raise ValueError(
            "output_attentions=True is not supported with h2o_kv.KVCache: its attention never builds the "
            "[queries x keys] probability matrix (use a stock cache to inspect attention weights)"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = layer.forward_attention(
        query,
        attention_mask,
        scaling=scaling,
        window=kwargs.get("sliding_window") or getattr(module, "sliding_window", None),
        softcap=kwargs.get("softcap"),
        config=getattr(module, "config", None),
    )
    return out, None


def _materialised_mask(batch_size: int, q_length: int, *args, **kwargs):
    """SDPA's boolean mask, always built: the cache reads padding from its diagonal.

    Building it also marks the forward call as an h2o-kv one, so a KVCache can tell on its first
    update that the model was enabled (a model that was not builds another implementation's mask).
    """
    mark_forward(batch_size, q_length)
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(batch_size, q_length, *args, **kwargs)


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
    layer_types = set(getattr(text_config(config), "layer_types", None) or ["full_attention"])
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

"""Several `KVCache`s stepped by one model call, a row each: `Stacked(caches)`.

A study compares many caches of one prompt (policies, fractions, the questions of a compressed context). Decoding
each alone reads every weight of the model once per cache and token, which on a CPU is most of a decode step: at
batch 1 a step is bound by the weights' bytes, at batch 16 it costs a few times as much for 16 tokens. `Stacked` is
the `past_key_values` of one batched call whose row r is `caches[r]`'s one sequence: the model's projections and
its head run once over every row, and each row's attention is its own cache's (its policy, budget, storage and
eviction), called with that row's query and mask exactly as when that cache is the call's only cache. Rows may
stand at different positions (pass each row's `position_ids`). Decode steps only, one new token per row: a prompt
(or a question) goes into each cache alone.

A row's logits can differ from its cache's solo call by the rounding of a batched matrix product: the caches and
their attention are the same, the projections' sums may be ordered otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from h2o_kv.cache.attention import hand_off, mark_forward, take_forward_mark
from h2o_kv.cache.kvcache import KVCache

__all__ = ["Stacked"]


class Stacked(Cache):
    """One decode call over `caches` (each a one-sequence `KVCache` that has read its prompt), row r being
    `caches[r]`. The caches are used in place: after the call each holds its row's new token, as after its own call.
    The model's mask and offsets are read from the first cache (a decode step's mask covers only the new token)."""

    def __init__(self, caches: Sequence[KVCache]) -> None:
        rows = list(caches)
        if not rows:
            raise ValueError("Stacked needs at least one KVCache")
        for cache in rows:
            if not isinstance(cache, KVCache):
                raise TypeError(f"Stacked stacks h2o_kv.KVCache objects, got {type(cache).__name__}")
            if cache.batch_size != 1:
                raise ValueError(f"each stacked KVCache holds one sequence that has read its prompt, got a cache "
                                 f"of {cache.batch_size} rows")  # fmt: skip
        if len({id(cache) for cache in rows}) != len(rows):
            raise ValueError("a KVCache is stacked twice: each row needs its own cache (KVCache.fork)")
        if len({len(cache.layers) for cache in rows}) != 1:
            raise ValueError("the stacked caches were filled by models with different numbers of layers")
        super().__init__(layers=list(rows[0].layers))
        self.rows = rows

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Each row's key and value into its own cache; the next attention call goes to every row's layer."""
        batch, _, n, _ = key_states.shape
        if batch != len(self.rows) or n != 1:
            raise ValueError(f"a Stacked call is one decode step of its {len(self.rows)} caches: input ids "
                             f"[{len(self.rows)}, 1], got [{batch}, {n}]")  # fmt: skip
        if layer_idx == 0 and take_forward_mark() not in ((batch, n), (1, n)):
            raise RuntimeError("Stacked needs the model's attention to go through h2o-kv: call h2o_kv.enable(model)")
        layers = []
        for row, cache in enumerate(self.rows):
            if layer_idx == 0:
                mark_forward(1, n)  # each cache checks, at its first layer, that it is in an h2o-kv call of its own
            cache.update(key_states[row : row + 1], value_states[row : row + 1], layer_idx)
            layers.append(cache.layers[layer_idx])
        hand_off(_RowLayers(layers), key_states)
        return key_states, value_states


class _RowLayers:
    """The layers of one model layer across the stacked caches: the attention call h2o-kv routes to it is split by
    row, each row's query to its own cache's layer."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.pending = True  # as a KVLayer with keys waiting for their attention call (attention.py's check)

    def forward_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, **options) -> torch.Tensor:
        self.pending = None
        outs = []
        for row, layer in enumerate(self.layers):
            mask = None if attention_mask is None else attention_mask[row : row + 1]
            outs.append(layer.forward_attention(query[row : row + 1], mask, **options))
        return torch.cat(outs)

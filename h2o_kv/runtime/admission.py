"""KV memory accounting for the engine's admission: the slots, and bytes, a request's cache can take.

A request is admitted by the most KV bytes it can hold: its slots per (layer, KV head) at their widest
(while decoding, or while its prompt goes in) times the bytes of one slot summed over layers and KV heads.
While a KVzip prompt goes in (its reconstruction pass, reconstructing.py) it holds the whole prompt and then its
longest reconstruction call: min(prompt, chunk) tokens of it after the repeat prompt (`SlotCount.pass_extra`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from h2o_kv.cache.layer import GROWTH
from h2o_kv.cache.rows import ROW_BLOCK
from h2o_kv.errors import ContextTooLong, KVMemoryExceeded
from h2o_kv.policies import Policy
from h2o_kv.runtime.compress import CHUNK


class SlotCount:
    """Slots per layer and KV head for a policy and request size, under one engine's mode and prefill chunk. `in_place`:
    a bounded policy's rows are kept in place (batch.py), each reserved at its capacity (plus the incoming token's
    slot, rounded up to `ROW_BLOCK` slots) from the join on, so that it never grows while it decodes. `pass_extra()`:
    the most tokens a KVzip reconstruction call adds to its chunk (`compress.piece_overhead`), asked once, when a
    KVzip request is first counted. `headroom`: the engine's (`KVCache(headroom=)`), slots past a bounded capacity."""

    def __init__(self, config, dtype: torch.dtype, kv_dtype: str | None, mode: str, prefill_chunk: int | None,
                 in_place: bool = False, pass_extra: Callable[[], int] = lambda: 0,
                 headroom: int = 0) -> None:  # fmt: skip
        self.config, self.mode, self.prefill_chunk, self.in_place = config, mode, prefill_chunk, in_place
        self.headroom = headroom
        self.pass_extra = functools.cache(pass_extra)
        self.layout = kv_layout(config, dtype, kv_dtype)  # bytes of one slot over every layer and KV head
        self._layer_policies = functools.lru_cache(maxsize=256)(self._own_policies)  # admission runs every step

    def bytes(self, policy: Policy, prompt_len: int, max_tokens: int) -> int:
        """Most KV bytes a request can hold while decoding (its admission size)."""
        return self.slots(policy, prompt_len, max_tokens)[0] * self.layout

    def slots(self, policy: Policy, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        """(slots per layer and KV head while decoding, most slots while its prompt goes in).

        With per-layer budgets (`LayerBudgets`) it is the mean over layers, rounded up, of each layer's
        own count, so that slots x `layout` covers every layer's slots, not the mean budget's.
        """
        own = self._layer_policies(policy)
        if own is None:
            return self._layer_slots(policy, prompt_len, max_tokens)
        counts = [self._layer_slots(p, prompt_len, max_tokens) for p in own]
        return -(-sum(c[0] for c in counts) // len(own)), -(-sum(c[1] for c in counts) // len(own))

    def bounded(self, policy: Policy) -> bool:
        """Whether a cache of `policy` holds a bounded number of slots per row (drop mode, a capacity): its batch
        can keep free rows in place (`KVCache.rows_in_place`)."""
        return self.mode == "drop" and policy.capacity(torch.ones(1, dtype=torch.long)) is not None

    def _own_policies(self, policy: Policy) -> tuple[Policy, ...] | None:
        """Each layer's own policy, or None when every layer keeps `policy` itself."""
        own = tuple(policy.for_layer(i, self.config) for i in range(int(self.config.num_hidden_layers)))
        return None if all(p is policy for p in own) else own

    def pass_call(self, prompt_len: int) -> int:
        """Tokens of a KVzip prompt's longest reconstruction call: a chunk of it after the repeat prompt."""
        return min(prompt_len, self.prefill_chunk or CHUNK) + self.pass_extra()

    def _layer_slots(self, policy: Policy, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        capacity = policy.capacity(torch.tensor([prompt_len]))
        held = None  # KVzip's pass: the prompt held, then its longest reconstruction call (+1: a one-token chunk's)
        if policy.reconstructs:
            held = prompt_len + self.pass_call(prompt_len) + 1
        if self.mode == "mask":  # nothing is freed: every token keeps its slot (decoding reuses the pass's last ones)
            return (prompt_len + max_tokens, prompt_len) if held is None else (max(prompt_len + max_tokens, held), held)
        if capacity is None:
            final = -(-(prompt_len + max_tokens) // GROWTH) * GROWTH
            return final, -(-prompt_len // GROWTH) * GROWTH
        kept = int(capacity) + self.headroom  # after the prompt (`KVCache(headroom=)`); a kept prefix's fork is past it
        decode = min(kept, prompt_len + max_tokens) + 1
        if self.in_place:  # a row in place is reserved at its capacity, in blocks (`KVLayer.write_row`)
            decode = -(-(kept + 1) // ROW_BLOCK) * ROW_BLOCK
        return decode, min(prompt_len, kept + (self.prefill_chunk or prompt_len)) + 1 if held is None else held


def admission_bytes(count: SlotCount, policy: Policy, prompt_len: int, max_tokens: int, *, context: int,
                    kv_memory: int | None) -> int:  # fmt: skip
    """The KV bytes a request is admitted by (`SlotCount.bytes`). Refuses a request that could never run right:
    positions past the model's `context` (ContextTooLong: a bounded cache bounds memory, not positions, and the
    model was never trained past its context; a KVzip prompt's reconstruction calls read positions after it too), or
    more bytes than `kv_memory` (KVMemoryExceeded)."""
    if prompt_len + max_tokens > context:
        unbounded = policy.capacity(torch.tensor([prompt_len])) is None
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the model's context of {context} "
            + (f"tokens with the unbounded {policy.describe()} cache" if unbounded else
               f"tokens: {policy.describe()} bounds the KV memory, not the positions the model reads"),
            prompt_tokens=prompt_len, max_tokens=max_tokens, context=context,
        )  # fmt: skip
    if policy.reconstructs and prompt_len + count.pass_call(prompt_len) > context:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) + its longest KVzip reconstruction call ({count.pass_call(prompt_len)}) "
            f"exceed the model's context of {context} tokens: the pass reads positions after the prompt",
            prompt_tokens=prompt_len, max_tokens=max_tokens, context=context,
        )  # fmt: skip
    kv_bytes = count.bytes(policy, prompt_len, max_tokens)
    # what admitting it projects with nothing else running (`Scheduler.projected`): its row while decoding and its
    # prompt going in; more than `kv_memory` and it would wait for ever
    decode, prompt = count.slots(policy, prompt_len, max_tokens)
    alone = (decode + prompt) * count.layout
    if kv_memory is not None and alone > kv_memory:
        raise KVMemoryExceeded(
            f"this request needs {alone} bytes of KV cache under {policy.describe()} (its prompt going in, then its "
            f"rows decoding), more than the {kv_memory} allowed: shorten the prompt or max_tokens, or lower the "
            "budget",
            needed=alone, allowed=kv_memory,
        )  # fmt: skip
    return kv_bytes


def kv_layout(config, dtype: torch.dtype, kv_dtype: str | None = None) -> int:
    """Bytes of one slot summed over layers and KV heads: key + value (+ their int8 scales) + position +
    score (+ last)."""
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    if kv_dtype == "int8":
        return layers * kv_heads * (2 * head_dim + 2 * 4 + 8 + 4 + 4)
    element = torch.empty(0, dtype=dtype).element_size()
    return layers * kv_heads * (2 * head_dim * element + 8 + 4 + 4)

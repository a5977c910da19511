"""Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference", arXiv 2407.11550): a layer's budget shared by its KV heads.

A uniform policy keeps `budget` tokens in every KV head. Ada-KV keeps `heads x budget` tokens per
layer and lets the heads compete for them: the layer's lowest-priority tokens go first, whichever
head holds them, so a head whose attention is spread keeps more and a focused head fewer. The
attention probabilities each head pays sum to one per query, which makes scores comparable across
heads. The memory is real: a head-pooled layer stores its slots in one row shared by the heads, each
slot tagged with its head (`h2o_kv.cache.pooled`), so the cache holds `heads x (budget + 1)` slots per layer,
as the uniform policy does, however unevenly the heads share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState, Wrapper


@dataclass(frozen=True)
class AdaKV(Wrapper):
    """`inner`'s ranking over a layer's pooled slots; `inner`'s capacity is the mean per KV head."""

    inner: Policy

    head_pooled = True

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Policy) or isinstance(self.inner, AdaKV):
            raise TypeError(f"AdaKV wraps one h2o_kv policy, got {self.inner!r}")
        if self.inner.score_shared:
            raise ValueError("AdaKV pools a layer's heads already; an inner policy with shared=True means nothing")
        if self.inner.needs_keys:  # a pooled row holds every head's keys: one anchor would mix the heads
            raise ValueError(f"AdaKV cannot pool {self.inner.describe()}: it ranks each KV head by its own keys")

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return self.inner.capacity(prompt_len)

    def priority(self, state: SlotState) -> torch.Tensor:
        return self.inner.priority(state)

    def for_layer(self, layer_idx: int, config) -> Policy:
        own = self.inner.for_layer(layer_idx, config)
        return self if own is self.inner else AdaKV(own)

    def describe(self) -> str:
        return f"AdaKV({self.inner.describe()})"

"""Full cache: keeps every token. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState


@dataclass(frozen=True)
class Full(Policy):
    """Never evicts. With `h2o_kv.KVCache(Full())` the model's outputs equal the stock cache's."""

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return None

    def priority(self, state: SlotState) -> torch.Tensor:  # never called: capacity is unbounded
        return torch.zeros_like(state.score)

    def describe(self) -> str:
        return "Full"

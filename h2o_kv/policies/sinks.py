"""Protected attention sinks for any policy (Xiao et al., 2023, arXiv 2309.17453, section 3.2).

The first few tokens of a sequence receive attention from every later query whatever they say;
evicting them hurts. `Sinks(H2O(budget=0.2), sinks=4)` keeps them forever, inside the inner policy's
capacity, and ranks the rest as the inner policy does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState, Wrapper, check_budget, per_prompt


@dataclass(frozen=True)
class Sinks(Wrapper):
    inner: Policy
    sinks: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Policy) or isinstance(self.inner, Sinks):
            raise TypeError(f"Sinks wraps one h2o_kv policy, got {self.inner!r}")
        check_budget("sinks", self.sinks)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return self.inner.capacity(prompt_len)

    def priority(self, state: SlotState) -> torch.Tensor:
        return self.inner.priority(state).masked_fill(state.pos < self.sinks, float("inf"))

    def protected_sinks(self, state: SlotState) -> torch.Tensor:
        inner = self.inner.protected_sinks(state)
        own = per_prompt(state, "sinks", lambda prompt_len: torch.full_like(prompt_len, self.sinks))
        return own if inner is None else torch.maximum(own, inner)

    def describe(self) -> str:
        return f"Sinks({self.inner.describe()}, sinks={self.sinks})"

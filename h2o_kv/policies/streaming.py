"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState, check_budget, check_size, per_prompt, tokens_of


@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Keeps the first `sinks` tokens of the sequence forever, plus the newest `window` tokens.

    Or give a total `budget` (tokens, or a fraction of the prompt) instead of `window`: the window is
    then budget - sinks, and a budget too small for the sinks keeps budget - 1 sinks and one recent token.
    """

    sinks: int = 4
    window: int | None = None
    budget: int | float | None = None

    def __post_init__(self) -> None:
        if self.sinks is None:
            raise TypeError("StreamingLLM: sinks must be an int >= 0, got None")
        check_budget("sinks", self.sinks, allow_zero=True)
        if (self.window is None) == (self.budget is None):
            given = "neither" if self.window is None else "both"
            raise ValueError(f"StreamingLLM takes a `window` (tokens after the sinks) or a total `budget`, got {given}")
        check_budget("window", self.window)
        check_size("budget", self.budget)

    def _sinks(self, prompt_len: torch.Tensor) -> torch.Tensor:
        if self.budget is None:
            return torch.full_like(prompt_len, self.sinks)
        return (tokens_of(self.budget, prompt_len) - 1).clamp(max=self.sinks)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        if self.budget is None:
            return torch.full_like(prompt_len, self.sinks + self.window)
        return tokens_of(self.budget, prompt_len)

    def priority(self, state: SlotState) -> torch.Tensor:
        age_order = state.pos.to(torch.float32)
        return age_order.masked_fill(state.pos < per_prompt(state, "sinks", self._sinks), float("inf"))

    def describe(self) -> str:
        if self.budget is None:
            return f"StreamingLLM(sinks={self.sinks}, window={self.window})"
        return f"StreamingLLM(sinks={self.sinks}, budget={self.budget:g})"

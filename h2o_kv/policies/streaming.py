"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotState, check_budget


@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Keeps the first `sinks` tokens of the sequence forever, plus the newest `window` tokens."""

    sinks: int = 4
    window: int = 252

    def __post_init__(self) -> None:
        check_budget("sinks", self.sinks, allow_zero=True)
        check_budget("window", self.window)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return torch.full_like(prompt_len, self.sinks + self.window)

    def priority(self, state: SlotState) -> torch.Tensor:
        age_order = state.pos.to(torch.float32)
        return age_order.masked_fill(state.pos < self.sinks, float("inf"))

    def describe(self) -> str:
        return f"StreamingLLM(sinks={self.sinks}, window={self.window})"

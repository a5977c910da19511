"""Local (sliding) window: keep the `window` most recent tokens. The H2O paper's main baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotState, check_budget


@dataclass(frozen=True)
class Local(Policy):
    """Keeps the newest `window` tokens; evicts the oldest."""

    window: int

    def __post_init__(self) -> None:
        check_budget("window", self.window)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return torch.full_like(prompt_len, self.window)

    def priority(self, state: SlotState) -> torch.Tensor:
        return state.pos.to(torch.float32)

    def describe(self) -> str:
        return f"Local(window={self.window})"

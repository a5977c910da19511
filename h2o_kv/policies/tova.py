"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotState, check_budget


@dataclass(frozen=True)
class TOVA(Policy):
    """Evicts the token the most recent query attended to least (averaged over the group's heads)."""

    budget: int
    needs_last = True

    def __post_init__(self) -> None:
        check_budget("budget", self.budget)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return torch.full_like(prompt_len, self.budget)

    def priority(self, state: SlotState) -> torch.Tensor:
        assert state.last is not None
        return state.last

    def describe(self) -> str:
        return f"TOVA(budget={self.budget})"

"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState, check_size, tokens_of


@dataclass(frozen=True)
class TOVA(Policy):
    """Evicts the token the most recent query attended to least (averaged over the group's heads)."""

    budget: int | float  # tokens, or a fraction of the prompt
    needs_last = True

    def __post_init__(self) -> None:
        check_size("budget", self.budget, required_by="TOVA")

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return tokens_of(self.budget, prompt_len)

    def priority(self, state: SlotState) -> torch.Tensor:
        assert state.last is not None
        return state.last

    def describe(self) -> str:
        return f"TOVA(budget={self.budget:g})"

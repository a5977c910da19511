"""Local (sliding) window: keep the `window` most recent tokens. The H2O paper's main baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState, check_size, tokens_of


@dataclass(frozen=True)
class Local(Policy):
    """Keeps the newest `window` tokens (an int, or a float fraction of the prompt); evicts the oldest."""

    window: int | float

    def __post_init__(self) -> None:
        check_size("window", self.window, required_by="Local")

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return tokens_of(self.window, prompt_len)

    def priority(self, state: SlotState) -> torch.Tensor:
        return state.pos.to(torch.float32)

    def describe(self) -> str:
        return f"Local(window={self.window:g})"

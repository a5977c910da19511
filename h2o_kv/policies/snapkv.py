"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

The last `window` queries of a prompt (the "observation window", where the question usually is)
already look at what the answer needs. When a prompt is prefilled, its tokens are ranked by the
attention of those queries only, max-pooled over `pool` neighbouring tokens so a heavy hitter keeps
its neighbours (a 7-digit number is several tokens that are only useful together); the window
itself is kept as the recent part. While decoding, scores keep accumulating as in H2O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import Policy, SlotState, check_budget, check_size, per_prompt, tokens_of


@dataclass(frozen=True)
class SnapKV(Policy):
    """Observation-window prompt scoring + pooling, then H2O-style accumulation while decoding.

    `budget`: tokens per (sequence, KV head), or a float fraction of the prompt. The newest
    min(window, ceil(budget / 2)) tokens are always kept; the rest go to the highest scores.
    """

    budget: int | float
    window: int = 32
    pool: int = 31  # wide: the needle's key words draw the attention, its value sits a few tokens on
    shared: bool = False  # heads of a layer rank a prompt together (max over heads), so all keep what any needs
    needs_scores = True

    def __post_init__(self) -> None:
        check_size("budget", self.budget)
        check_budget("window", self.window)
        check_budget("pool", self.pool)
        if not isinstance(self.shared, bool):
            raise TypeError(f"shared must be a bool, got {self.shared!r}")
        if self.pool % 2 == 0:
            raise ValueError(f"pool must be odd (a window centred on each token), got {self.pool}")

    @property
    def score_window(self) -> int:  # type: ignore[override]
        return self.window

    @property
    def score_pool(self) -> int:  # type: ignore[override]
        return self.pool

    @property
    def score_shared(self) -> bool:  # type: ignore[override]
        return self.shared

    def split(self, prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = tokens_of(self.budget, prompt_len)
        recent = (total - total // 2).clamp(max=self.window)
        return total - recent, recent

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return tokens_of(self.budget, prompt_len)

    def priority(self, state: SlotState) -> torch.Tensor:
        return torch.where(state.pos >= state.next_pos - self.protected_recent(state), float("inf"), state.score)

    def protected_recent(self, state: SlotState) -> torch.Tensor:
        return per_prompt(state, "recent", lambda prompt_len: self.split(prompt_len)[1])

    def describe(self) -> str:
        shared = ", shared" if self.shared else ""
        return f"SnapKV(budget={self.budget:g}, window={self.window}, pool={self.pool}{shared})"

"""H2O, the Heavy-Hitter Oracle (Zhang et al., 2023, arXiv 2306.14048, Algorithm 1).

Every token accumulates the attention it receives. The cache keeps the `recent` newest tokens
plus the `heavy` older ones with the highest accumulated attention ("heavy hitters").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import (
    Policy,
    SlotState,
    check_budget,
    check_ratio,
    check_size,
    per_prompt,
    ratio_of,
    tokens_of,
)


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters + recent window.

    Give token counts (`heavy`, `recent`); or a total `budget` (tokens, or a float fraction of the
    prompt) split evenly, or with a given `recent` (heavy = budget - recent); or the paper's
    fractions of the prompt length (`heavy_ratio`, `recent_ratio`). Fractions are sized from the
    prompt's length when the cache first sees it.
    """

    heavy: int | None = None
    recent: int | None = None
    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    budget: int | float | None = None
    decay: float = 1.0  # < 1: older attention counts less (scores *= decay per query); 1 is the paper's H2O
    normalize: bool = False  # rank by score / age (queries that could attend to the token), as cold-compress
    needs_scores = True

    def __post_init__(self) -> None:
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0.0 < self.decay <= 1.0:
            raise ValueError(f"H2O: decay must be a number in (0, 1], got {self.decay!r}")
        if not isinstance(self.normalize, bool):
            raise TypeError(f"H2O: normalize must be a bool, got {self.normalize!r}")
        counts = self.heavy is not None or (self.recent is not None and self.budget is None)
        ratios = self.heavy_ratio is not None or self.recent_ratio is not None
        given = [
            name
            for name, on in (("heavy/recent", counts), ("ratios", ratios), ("budget", self.budget is not None))
            if on
        ]
        if len(given) > 1:
            raise ValueError(f"H2O: give one of heavy/recent, ratios or budget; got {' and '.join(given)}, not both")
        if not given:
            raise ValueError(
                "H2O needs a size: H2O(heavy=64, recent=64), H2O(budget=128), H2O(budget=0.2) "
                "or H2O(heavy_ratio=0.1, recent_ratio=0.1)"
            )
        if self.budget is not None:
            check_size("budget", self.budget)
            check_budget("recent", self.recent, allow_zero=True)
            if self.recent is not None and isinstance(self.budget, int) and self.recent > self.budget:
                raise ValueError(f"H2O: recent={self.recent} is larger than budget={self.budget}")
        elif counts:
            object.__setattr__(self, "heavy", 0 if self.heavy is None else self.heavy)
            object.__setattr__(self, "recent", 0 if self.recent is None else self.recent)
            check_budget("heavy", self.heavy, allow_zero=True)
            check_budget("recent", self.recent, allow_zero=True)
            if self.heavy + self.recent <= 0:
                raise ValueError("H2O: heavy + recent must be > 0 (a zero budget keeps nothing)")
        else:
            check_ratio("heavy_ratio", self.heavy_ratio)
            check_ratio("recent_ratio", self.recent_ratio)
            object.__setattr__(self, "heavy_ratio", float(self.heavy_ratio or 0.0))
            object.__setattr__(self, "recent_ratio", float(self.recent_ratio or 0.0))
            if self.heavy_ratio + self.recent_ratio <= 0:
                raise ValueError("H2O: heavy_ratio + recent_ratio must be > 0")

    def split(self, prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(heavy, recent) per sequence. Ratio budgets keep at least one recent token."""
        if self.budget is not None:
            total = tokens_of(self.budget, prompt_len)
            recent = total - total // 2 if self.recent is None else total.clamp(max=self.recent)
            return total - recent, recent
        if self.heavy_ratio is None:
            return torch.full_like(prompt_len, self.heavy), torch.full_like(prompt_len, self.recent)
        heavy = ratio_of(self.heavy_ratio, prompt_len)
        recent = ratio_of(self.recent_ratio, prompt_len).clamp(min=1)
        return heavy, recent

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        heavy, recent = self.split(prompt_len)
        return heavy + recent

    def priority(self, state: SlotState) -> torch.Tensor:
        is_recent = state.pos >= state.next_pos - self._recent(state)
        score = state.score
        if self.normalize:
            score = score / (state.next_pos - state.pos).clamp(min=1).to(score.dtype)
        return torch.where(is_recent, float("inf"), score)  # a new tensor in one kernel (masked_fill: copy, then fill)

    def protected_recent(self, state: SlotState) -> torch.Tensor | None:
        return None if self.normalize else self._recent(state)  # normalize ranks by score / age: not the kernel's

    def _recent(self, state: SlotState) -> torch.Tensor:
        return per_prompt(state, "recent", lambda prompt_len: self.split(prompt_len)[1])

    def describe(self) -> str:
        options = (f", decay={self.decay:g}" if self.decay != 1.0 else "") + (", normalize" if self.normalize else "")
        return self._describe_size()[:-1] + options + ")"

    def _describe_size(self) -> str:
        if self.budget is not None:
            recent = "" if self.recent is None else f", recent={self.recent}"
            return f"H2O(budget={self.budget:g}{recent})"
        if self.heavy_ratio is not None:
            return f"H2O(heavy_ratio={self.heavy_ratio:g}, recent_ratio={self.recent_ratio:g})"
        return f"H2O(heavy={self.heavy}, recent={self.recent})"

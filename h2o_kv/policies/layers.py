"""Budgets that differ by layer, with the same total: PyramidKV's schedule and a sliding-window-aware one.

A policy's budget is tokens per (sequence, KV head) in every layer. `LayerBudgets` keeps the mean
over layers at that budget (so the cache's bytes stay those of the uniform split) and gives each
layer its share, computed from the model's config when the layer first sees a prompt:

- "pyramid" (PyramidKV, Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
  Pyramidal Information Funneling", arXiv 2406.02069): lower layers spread their attention widely
  and get more; shares fall linearly from 2 - 1/beta at the first layer to 1/beta at the last.
- "global" (h2o-kv's own): in a model that mixes sliding-window and full-attention layers (Gemma 3),
  a sliding layer can never look further back than its window, so a token it keeps for later is
  only useful until it leaves the window. A sliding layer keeps `sliding_share` of the mean and the
  full-attention layers share the rest, which is where a needle far back in the prompt survives.
  A model without sliding layers gets the uniform split.

Each layer's policy is the inner one with its budget scaled by the layer's share (`scale_budget`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from h2o_kv.policies.base import Policy, SlotState, Wrapper
from h2o_kv.policies.full import Full
from h2o_kv.policies.h2o import H2O
from h2o_kv.policies.local import Local
from h2o_kv.policies.sinks import Sinks
from h2o_kv.policies.streaming import StreamingLLM

SCHEDULES = ("pyramid", "global")


@dataclass(frozen=True)
class LayerBudgets(Wrapper):
    """`inner` with a per-layer budget: `schedule` "pyramid" (PyramidKV) or "global" (sliding layers give
    their budget to full-attention layers). The mean over layers is the inner policy's budget."""

    inner: Policy
    schedule: str = "pyramid"
    beta: float = 20.0  # pyramid: the last layer keeps 1/beta of the mean budget, the first 2 - 1/beta
    sliding_share: float = 0.25  # global: a sliding-window layer keeps this share of the mean budget

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Policy) or isinstance(self.inner, LayerBudgets):
            raise TypeError(f"LayerBudgets wraps one h2o_kv policy, got {self.inner!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name, value, low, high in (("beta", self.beta, 1.0, 1e6), ("sliding_share", self.sliding_share, 0.0, 1.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        scale_budget(self.inner, 1.0)  # refuse, at construction, a policy whose budget cannot be scaled

    def capacity(self, prompt_len):
        return self.inner.capacity(prompt_len)  # the mean; each layer uses `for_layer`'s policy

    def priority(self, state: SlotState):
        return self.inner.priority(state)

    def shares(self, config: Any) -> list[float]:
        """Each layer's budget as a multiple of the mean (the list averages to 1)."""
        layers = int(config.num_hidden_layers)
        if self.schedule == "pyramid":
            low = 1.0 / self.beta
            if layers == 1:
                return [1.0]
            return [(2.0 - low) - (2.0 - 2.0 * low) * i / (layers - 1) for i in range(layers)]
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
        sliding = [t == "sliding_attention" for t in types]
        full = layers - sum(sliding)
        if full == 0 or full == layers:
            return [1.0] * layers
        rest = (layers - self.sliding_share * sum(sliding)) / full
        return [self.sliding_share if s else rest for s in sliding]

    def for_layer(self, layer_idx: int, config: Any) -> Policy:
        return scale_budget(self.inner, self.shares(config)[layer_idx])

    def describe(self) -> str:
        knob = f"beta={self.beta:g}" if self.schedule == "pyramid" else f"sliding_share={self.sliding_share:g}"
        return f"LayerBudgets({self.inner.describe()}, {self.schedule}, {knob})"


def scale_budget(policy: Policy, share: float) -> Policy:
    """`policy` keeping `share` times its budget: token counts are rounded (at least 1), fractions of
    the prompt multiplied (at most the whole prompt)."""

    def scaled(value):
        if value is None:
            return None
        if isinstance(value, float):
            return min(1.0, value * share)
        return max(1, round(value * share))

    if isinstance(policy, Full):
        return policy
    if isinstance(policy, Sinks):
        return dataclasses.replace(policy, inner=scale_budget(policy.inner, share))
    if isinstance(policy, Local):
        return dataclasses.replace(policy, window=scaled(policy.window))
    if isinstance(policy, StreamingLLM) and policy.budget is None:
        return dataclasses.replace(policy, window=scaled(policy.window))
    if isinstance(policy, H2O) and policy.budget is None:
        fields = ("heavy", "recent") if policy.heavy is not None else ("heavy_ratio", "recent_ratio")
        return dataclasses.replace(policy, **{f: scaled(getattr(policy, f)) for f in fields})
    if isinstance(getattr(policy, "budget", None), (int, float)):
        return dataclasses.replace(policy, budget=scaled(policy.budget))
    raise TypeError(f"cannot scale the budget of {policy.describe()} by layer")

"""The interface every eviction policy implements (see docs/eviction.md, "Policies").

A policy is a small frozen dataclass. It says how many tokens a (sequence, KV head) may keep
(`capacity`) and, when there are too many, which go first (`priority`: lowest is evicted first,
ties go to the oldest token). The cache does the bookkeeping; a policy only ranks tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from h2o_kv.policies.budget import MAX_TOKENS


@dataclass(frozen=True)
class SlotState:
    """What a policy may look at, per (sequence, KV head, slot). Empty slots are masked by the cache."""

    pos: torch.Tensor  # [B, H, S] int64 absolute position of the token in each slot, -1 if empty
    score: torch.Tensor  # [B, H, S] float32 attention accumulated since the token arrived
    last: torch.Tensor | None  # [B, H, S] float32 attention from the most recent query, if needed
    next_pos: torch.Tensor  # [B, 1, 1] int64 position the next token of each sequence will take
    prompt_len: torch.Tensor  # [B, 1, 1] int64 real tokens in the first call (for ratio budgets)
    memo: dict = field(default_factory=dict)  # the layer's, kept while `prompt_len` is one tensor (`per_prompt`)
    keys: torch.Tensor | None = None  # [B, H, S, D] float32 stored keys (int8 dequantized), if `needs_keys`


T = TypeVar("T")


def per_prompt(state: SlotState, key: str, compute: Callable[[torch.Tensor], T]) -> T:
    """`compute(state.prompt_len)`, once per layer and batch: a decode step evicts in every layer, and
    values that depend only on the prompt lengths (an H2O split) are a few small kernels each time."""
    if key not in state.memo:
        state.memo[key] = compute(state.prompt_len)
        if isinstance(state.memo, PromptMemo):
            state.memo.computes[key] = compute
    return state.memo[key]


class PromptMemo(dict):
    """A layer's `per_prompt` values with how each was computed, so that when a row's prompt length changes in place
    (a sequence joins or leaves a free row) they are computed again into the same tensors (`refresh`): a captured
    decode step goes on reading them."""

    def __init__(self) -> None:
        super().__init__()
        self.computes: dict[str, Callable] = {}

    def refresh(self, prompt_len: torch.Tensor) -> None:
        for key, compute in self.computes.items():
            old, new = self[key], compute(prompt_len)
            olds, news = (old, new) if isinstance(old, tuple) and isinstance(new, tuple) else ((old,), (new,))
            if len(olds) == len(news) and all(map(_fits, olds, news)):
                for a, b in zip(olds, news):
                    a.copy_(b)
            else:  # a new value (a captured step sees the change: `KVCache.steady_key`)
                self[key] = new


def _fits(old, new) -> bool:
    """Whether `new` can be copied into the tensor `old` (same shape and dtype, not an expanded view)."""
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return False
    return old.shape == new.shape and old.dtype == new.dtype and torch._debug_has_internal_overlap(old) == 0


@dataclass(frozen=True)
class Policy:
    """Base class. Subclasses set `needs_scores` / `needs_last` / `needs_keys` so the cache only gathers what is
    used."""

    needs_scores: ClassVar[bool] = False
    needs_last: ClassVar[bool] = False
    needs_keys: ClassVar[bool] = False  # `priority` reads the kept keys (`SlotState.keys`: KeyDiff)
    # the context is ranked by a reconstruction pass (KVzip: `h2o_kv.compress`, cache/reconstruct.py), not by a
    # plain prompt call, which the cache then refuses
    reconstructs: ClassVar[bool] = False
    # How scores accumulate (the cache reads these; subclasses may make them fields):
    score_window: ClassVar[int | None] = None  # a multi-token call scores with its last `score_window` queries only
    score_pool: ClassVar[int] = 1  # ... max-pooled over that many neighbouring kept tokens (by position)
    decay: ClassVar[float] = 1.0  # kept scores are multiplied by decay**n before a call of n queries adds to them
    score_shared: ClassVar[bool] = False  # ... and shared by a layer's KV heads: each token gets the heads' max
    head_pooled: ClassVar[bool] = False  # a layer's KV heads share heads x capacity slots (AdaKV, pooled.py)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        """Most tokens kept per (sequence, KV head), one value per sequence; None means unbounded."""
        raise NotImplementedError

    def priority(self, state: SlotState) -> torch.Tensor:
        """[B, H, S] float keep-priority: the lowest is evicted first (ties: the oldest). Called in every
        layer at every decode step: compute what depends only on the prompt lengths with `per_prompt`."""
        raise NotImplementedError

    def fraction_of_prompt(self) -> bool:
        """Whether the policy is sized by the prompt (a fraction: its capacity differs for two prompt lengths): its
        tokens are then known only when the cache sees the prompt, and a short prompt may leave very few
        (`budget.short_fraction`)."""
        capacity = self.capacity(torch.tensor([[[1000]], [[1999]]]))
        return capacity is not None and bool(capacity[0] != capacity[1])

    def protected_recent(self, state: SlotState) -> torch.Tensor | None:
        """`recent` [B, 1, 1] when `priority` is the score with the `recent` newest positions kept,
        `torch.where(state.pos >= state.next_pos - recent, inf, state.score)` (H2O, SnapKV): a decode step on a
        CPU then ranks inside h2o-kv's C++ kernel (`native.decode_step`). None for any other priority."""
        return None

    def protected_sinks(self, state: SlotState) -> torch.Tensor | None:
        """`sinks` [B, 1, 1] when positions below it are kept too, whatever their score (`Sinks` around a policy with
        `protected_recent`): the decode kernels rank by `priority` masked there. None: no sinks."""
        return None

    def for_layer(self, layer_idx: int, config) -> Policy:
        """The policy layer `layer_idx` of a model with this `config` applies (per-layer budgets:
        `LayerBudgets`); the same policy in every layer by default."""
        return self

    def describe(self) -> str:
        """Short human-readable form, used by the CLI and result tables."""
        return repr(self)


@dataclass(frozen=True)
class BudgetAndRecent(Policy):
    """A policy sized by `budget` (tokens, or a fraction of the prompt) that keeps its newest min(`recent`,
    ceil(capacity / 2)) tokens whatever their rank (KeyDiff, KVzip)."""

    budget: int | float
    recent: int = 8

    def __post_init__(self) -> None:
        check_size("budget", self.budget, required_by=type(self).__name__)
        if self.recent is None:
            raise TypeError("recent must be an int (0 keeps no newest tokens), got None")
        check_budget("recent", self.recent, allow_zero=True)

    def capacity(self, prompt_len: torch.Tensor) -> torch.Tensor | None:
        return tokens_of(self.budget, prompt_len)

    def split(self, prompt_len: torch.Tensor) -> torch.Tensor:
        """The newest tokens kept whatever their rank, per sequence: min(recent, ceil(capacity / 2))."""
        return self.half(prompt_len).clamp(max=self.recent)

    def half(self, prompt_len: torch.Tensor) -> torch.Tensor:
        """ceil(capacity / 2) per sequence: the most the newest tokens kept whatever their rank may take."""
        total = tokens_of(self.budget, prompt_len)
        return total - total // 2


class Wrapper(Policy):
    """A policy around an `inner` one (Sinks, LayerBudgets): how scores accumulate is the inner policy's."""

    inner: Policy

    needs_scores = property(lambda self: self.inner.needs_scores)  # type: ignore[assignment]
    needs_last = property(lambda self: self.inner.needs_last)  # type: ignore[assignment]
    needs_keys = property(lambda self: self.inner.needs_keys)  # type: ignore[assignment]
    reconstructs = property(lambda self: self.inner.reconstructs)  # type: ignore[assignment]
    score_window = property(lambda self: self.inner.score_window)  # type: ignore[assignment]
    score_pool = property(lambda self: self.inner.score_pool)  # type: ignore[assignment]
    decay = property(lambda self: self.inner.decay)  # type: ignore[assignment]
    score_shared = property(lambda self: self.inner.score_shared)  # type: ignore[assignment]
    head_pooled = property(lambda self: self.inner.head_pooled)  # type: ignore[assignment]

    def protected_recent(self, state: SlotState) -> torch.Tensor | None:
        return self.inner.protected_recent(state)

    def protected_sinks(self, state: SlotState) -> torch.Tensor | None:
        return self.inner.protected_sinks(state)


def check_budget(name: str, value: int | None, *, allow_zero: bool = False) -> None:
    """Reject budgets that cannot mean anything, before any cache is touched."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    if value > MAX_TOKENS:
        raise ValueError(f"{name} must be at most {MAX_TOKENS} tokens, got {value}")


def check_ratio(name: str, value: float | None) -> None:
    """A fraction of the prompt in [0, 1]: a number (not a bool, not a string), like the count fields."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0.0 <= float(value) <= 1.0:  # also rejects nan and inf
        raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")


def ratio_of(ratio: float, prompt_len: torch.Tensor) -> torch.Tensor:
    """floor(ratio * prompt length), as the reference code's int(ratio * L)."""
    return torch.floor(prompt_len.to(torch.float64) * float(ratio)).to(torch.int64)


def check_size(name: str, value: int | float | None, required_by: str | None = None) -> None:
    """A budget field: an int token count >= 1, or a float fraction of the prompt in (0, 1]; None is refused when
    policy `required_by` needs the field, else left alone."""
    if value is None:
        if required_by is not None:
            raise ValueError(f"{required_by} needs a {name}: tokens (64) or a fraction of the prompt (0.2)")
        return
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:  # also rejects nan and inf
            raise ValueError(f"{name} as a fraction of the prompt must be in (0, 1], got {value!r}")
        return
    check_budget(name, value)


def tokens_of(value: int | float, prompt_len: torch.Tensor) -> torch.Tensor:
    """Tokens for a budget field per sequence: an int as is, a fraction f as max(1, floor(f * prompt length))."""
    if isinstance(value, float):
        return ratio_of(value, prompt_len).clamp(min=1)
    return torch.full_like(prompt_len, value)

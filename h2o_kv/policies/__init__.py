"""Eviction policies: what to evict. One small file per policy."""

from .base import Policy, SlotState
from .full import Full
from .h2o import H2O
from .local import Local
from .streaming import StreamingLLM
from .tova import TOVA

__all__ = [
    "Policy",
    "SlotState",
    "Full",
    "H2O",
    "Local",
    "StreamingLLM",
    "TOVA",
    "NAMES",
    "from_name",
    "Budget",
    "budget_tokens",
    "is_fraction",
]

NAMES = ("h2o", "local", "streamingllm", "tova", "full")

Budget = float | int | None  # None: the Full cache


def is_fraction(budget: Budget) -> bool:
    """A float budget is a fraction of the length; an int is a token count."""
    return isinstance(budget, float)


def budget_tokens(budget: Budget, length: int) -> int | None:
    """Tokens kept per (sequence, KV head) for a budget at a sequence length (None: unbounded).

    A fraction f gives int(f * length), as the paper's int(ratio * L), but at least 1 token.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a float fraction or an int token count, got {budget!r}")
    if is_fraction(budget):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional budget must be in (0, 1], got {budget}")
        return max(1, int(budget * length))
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    return int(budget)


def from_name(name: str, budget: int | None = None, *, sinks: int = 4) -> Policy:
    """A policy at a total budget of `budget` tokens per (sequence, KV head), split the usual way.

    H2O splits its budget evenly between heavy hitters and the recent window, as in the paper;
    StreamingLLM keeps `sinks` sink tokens and a window of the rest.
    """
    key = name.lower().replace("-", "").replace("_", "")
    if key == "full":
        return Full()
    if key not in NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(NAMES)}")
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget")
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if key == "h2o":
        return H2O(heavy=budget // 2, recent=budget - budget // 2)
    if key == "local":
        return Local(window=budget)
    if key == "tova":
        return TOVA(budget=budget)
    if budget <= sinks:
        raise ValueError(f"StreamingLLM needs a budget larger than its {sinks} sink tokens, got {budget}")
    return StreamingLLM(sinks=sinks, window=budget - sinks)

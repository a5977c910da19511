"""Eviction policies: what to evict. One small file per policy."""

from h2o_kv.policies.adakv import AdaKV
from h2o_kv.policies.base import MAX_TOKENS, Policy, SlotState, per_prompt
from h2o_kv.policies.full import Full
from h2o_kv.policies.h2o import H2O
from h2o_kv.policies.layers import LayerBudgets
from h2o_kv.policies.local import Local
from h2o_kv.policies.sinks import Sinks
from h2o_kv.policies.snapkv import SnapKV
from h2o_kv.policies.streaming import StreamingLLM
from h2o_kv.policies.tova import TOVA

__all__ = [
    "MAX_TOKENS",
    "Policy",
    "SlotState",
    "per_prompt",
    "Full",
    "H2O",
    "Local",
    "StreamingLLM",
    "TOVA",
    "SnapKV",
    "AdaKV",
    "Sinks",
    "LayerBudgets",
    "NAMES",
    "DEFAULT",
    "build",
    "policy_key",
    "parse_budget",
    "check_budget_value",
    "Budget",
    "budget_tokens",
    "is_fraction",
]

NAMES = ("h2o", "snapkv", "adakv", "pyramidkv", "globalkv", "local", "streamingllm", "tova", "full")
DEFAULT = "globalkv"  # the default of generate, demo, the engine and serve: the best in docs/accuracy.md

Budget = float | int | None  # None: the Full cache


def is_fraction(budget: Budget) -> bool:
    """A float budget is a fraction of the prompt; an int is a token count."""
    return isinstance(budget, float)


def check_budget_value(budget: Budget, what: str = "budget") -> None:
    """The one rule for budgets: an int >= 1 is tokens, a float in (0, 1] is a fraction of the prompt."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"{what} must be an int token count or a float fraction in (0, 1], got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:  # nan and inf fail here too
            raise ValueError(
                f"{what} {budget!r} means nothing: a float is a fraction of the prompt in (0, 1], an int is tokens"
            )
    elif not 1 <= budget <= MAX_TOKENS:
        raise ValueError(f"{what} as tokens must be in [1, {MAX_TOKENS}], got {budget}")


def parse_budget(text: str) -> int | float:
    """Text from a flag or a request: "64" is 64 tokens; "0.2" or "20%" is a fraction of the prompt.

    "1" is one token and "1.0" the whole prompt; "1.5", "0", "inf" and "nan" are refused.
    """
    s = str(text).strip()
    try:
        if s.endswith("%"):
            budget: int | float = float(s[:-1]) / 100
        elif s.lstrip("+-").isdigit():
            budget = int(s)
        else:
            budget = float(s)
    except ValueError:
        raise ValueError(
            f"budget {text!r} is not a number: give tokens (64) or a fraction of the prompt (0.2)"
        ) from None
    check_budget_value(budget)
    return budget


def budget_tokens(budget: Budget, length: int) -> int | None:
    """Tokens kept per (sequence, KV head) for a budget at a prompt length (None: unbounded).

    A fraction f gives max(1, int(f * length)), as the paper's int(ratio * L); an int is itself.
    """
    if budget is None:
        return None
    check_budget_value(budget)
    if is_fraction(budget):
        return max(1, int(budget * length))
    return int(budget)


def policy_key(name: str) -> str:
    """`name` as one of NAMES (case, "-" and "_" ignored: "StreamingLLM", "streaming-llm"); ValueError if none."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(NAMES)}")
    return key


def build(name: str, budget: Budget = None, *, sinks: int = 4) -> Policy:
    """The one way to turn a policy name and a budget into a policy (CLI, eval, bench and server).

    `budget` is tokens per (sequence, KV head) as an int, or a fraction of the prompt as a float in
    (0, 1], sized per sequence when the cache sees its prompt. H2O splits it evenly between heavy
    hitters and the recent window (the paper's 50/50); StreamingLLM keeps `sinks` sink tokens
    (budget - 1 when the budget is smaller) and a window of the rest. "full" takes no budget.
    "pyramidkv" and "globalkv" are SnapKV with per-layer budgets averaging `budget` (LayerBudgets:
    PyramidKV's schedule; sliding-window layers giving their budget to full-attention layers).
    "adakv" is SnapKV with each layer's budget shared by its KV heads (AdaKV: heads x budget per layer).
    """
    key = policy_key(name)
    if key == "full":
        if budget is not None:
            raise ValueError("policy 'full' keeps every token and takes no budget")
        return Full()
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget: tokens (64) or a fraction of the prompt (0.2)")
    check_budget_value(budget)
    if key == "h2o":
        return H2O(budget=budget)
    if key == "local":
        return Local(window=budget)
    if key == "tova":
        return TOVA(budget=budget)
    if key == "snapkv":
        return SnapKV(budget=budget)
    if key == "adakv":
        return AdaKV(SnapKV(budget=budget))
    if key in ("pyramidkv", "globalkv"):
        return LayerBudgets(SnapKV(budget=budget), "pyramid" if key == "pyramidkv" else "global")
    return StreamingLLM(sinks=sinks, budget=budget)

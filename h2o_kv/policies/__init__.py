"""Eviction policies: what to evict. One small file per policy; `build(name, budget)` makes one from a name.

The names and the budget rule (`budget.py`) import at once; the policy classes and `build` (torch) when first used.
"""

from h2o_kv.lazy import exports
from h2o_kv.policies.budget import (
    DEFAULT,
    FRACTION_FLOOR,
    MAX_TOKENS,
    NAMES,
    SERVE_DEFAULT,
    Budget,
    budget_tokens,
    check_budget_value,
    is_fraction,
    parse_budget,
    policy_key,
    short_fraction,
)

#: the rest of the package's names and the module each lives in (imported on first use: torch)
_LAZY = {
    name: f"h2o_kv.policies.{module}"
    for name, module in {
        "Policy": "base", "SlotState": "base", "per_prompt": "base", "Full": "full", "H2O": "h2o", "Local": "local",
        "StreamingLLM": "streaming", "TOVA": "tova", "SnapKV": "snapkv", "AdaKV": "adakv", "Sinks": "sinks",
        "KeyDiff": "keydiff", "KVzip": "kvzip",
        "LayerBudgets": "layers", "build": "builder",
    }.items()
}  # fmt: skip
CLASSES = ("Policy", "H2O", "Local", "StreamingLLM", "TOVA", "SnapKV", "KeyDiff", "KVzip", "AdaKV", "LayerBudgets",
           "Sinks", "Full")  # fmt: skip

__all__ = ["MAX_TOKENS", "NAMES", "DEFAULT", "SERVE_DEFAULT", "FRACTION_FLOOR", "Budget", "budget_tokens",
           "check_budget_value", "is_fraction", "parse_budget", "policy_key", "short_fraction", *_LAZY]  # fmt: skip

__getattr__ = exports(__name__, _LAZY)

"""`build(name, budget)`: the one policy builder (CLI, eval, bench and server)."""

from __future__ import annotations

from h2o_kv.errors import BadBudget
from h2o_kv.policies.adakv import AdaKV
from h2o_kv.policies.base import Policy
from h2o_kv.policies.budget import Budget, check_budget_value, policy_key
from h2o_kv.policies.full import Full
from h2o_kv.policies.h2o import H2O
from h2o_kv.policies.keydiff import KeyDiff
from h2o_kv.policies.kvzip import KVzip
from h2o_kv.policies.layers import LayerBudgets
from h2o_kv.policies.local import Local
from h2o_kv.policies.snapkv import SnapKV
from h2o_kv.policies.streaming import StreamingLLM
from h2o_kv.policies.tova import TOVA


def build(name: str, budget: Budget = None, *, sinks: int = 4) -> Policy:
    """The one way to turn a policy name and a budget into a policy (CLI, eval, bench and server).

    `budget` is tokens per (sequence, KV head) as an int, or a fraction of the prompt as a float in
    (0, 1], sized per sequence when the cache sees its prompt. H2O splits it evenly between heavy
    hitters and the recent window (the paper's 50/50); StreamingLLM keeps `sinks` sink tokens
    (budget - 1 when the budget is smaller) and a window of the rest. "full" takes no budget.
    "pyramidkv" and "globalkv" are SnapKV with per-layer budgets averaging `budget` (LayerBudgets:
    PyramidKV's schedule; sliding-window layers giving their budget to full-attention layers).
    "adakv" is SnapKV with each layer's budget shared by its KV heads (AdaKV: heads x budget per layer).
    "keydiff" and "kvzip" are query-agnostic (a context compressed before its question): KeyDiff ranks by keys,
    KVzip by a reconstruction pass that `h2o_kv.compress` runs (a plain prompt call refuses it); "kvzipwhole" ranks
    the whole cache at once when its pass ends (KVzip's own allocation: AdaKV's pooled rows, layers of their own size;
    the engine batches such requests where their layers, each as wide as its widest row's, fit its KV memory, else
    each decodes alone); "kvziplayer" ranks each
    layer's heads together (AdaKV's pooled rows, every layer at heads x budget, so its requests batch together);
    "kvzipwindow" is "kvzipwhole" whose context's last 32 queries also pick 30 % of each row first (a question inside
    the prompt kept as well as one that comes later; KVzip's `window`: `serve`'s default); "kvziplayerwindow" is
    "kvziplayer" with the window picking 60 % (every layer at heads x budget).
    """
    key = policy_key(name)
    if key == "full":
        if budget is not None:
            raise BadBudget("policy 'full' keeps every token and takes no budget")
        return Full()
    if budget is None:
        raise BadBudget(f"policy {name!r} needs a budget: tokens (64) or a fraction of the prompt (0.2)")
    check_budget_value(budget)
    if key == "h2o":
        return H2O(budget=budget)
    if key == "local":
        return Local(window=budget)
    if key == "tova":
        return TOVA(budget=budget)
    if key == "snapkv":
        return SnapKV(budget=budget)
    if key == "keydiff":
        return KeyDiff(budget=budget)
    if key == "kvzip":
        return KVzip(budget=budget)
    if key == "kvzipwhole":
        return AdaKV(KVzip(budget=budget, whole_cache=True))
    if key == "kvzipwindow":
        return AdaKV(KVzip(budget=budget, whole_cache=True, window=32, share=0.3))
    if key == "kvziplayerwindow":
        return AdaKV(KVzip(budget=budget, window=32, share=0.6))
    if key == "kvziplayer":
        return AdaKV(KVzip(budget=budget))
    if key == "adakv":
        return AdaKV(SnapKV(budget=budget))
    if key in ("pyramidkv", "globalkv"):
        return LayerBudgets(SnapKV(budget=budget), "pyramid" if key == "pyramidkv" else "global")
    return StreamingLLM(sinks=sinks, budget=budget)

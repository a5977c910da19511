"""A budget given as a fraction of the prompt that leaves very few tokens is warned about (docs/usage.md,
"Budgets"): the library warns once, naming the tokens kept and how to ask for more; token budgets, and
fractions that keep enough or evict nothing, do not warn."""

from __future__ import annotations

import warnings

import pytest
import torch

import h2o_kv
from h2o_kv import policies

from conftest import make_model, random_ids


def _prefill(policy, length: int) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("default")  # once per message, as a user sees it
        make_model("llama")(random_ids(1, length), past_key_values=h2o_kv.KVCache(policy), use_cache=True)
    return [w for w in caught if issubclass(w.category, UserWarning) and "keeps" in str(w.message)]


@pytest.mark.parametrize(
    "policy,length,kept",
    [(h2o_kv.H2O(budget=0.2), 30, 6), (h2o_kv.SnapKV(budget=0.1), 60, 6), (h2o_kv.Local(window=0.25), 40, 10),
     (h2o_kv.AdaKV(h2o_kv.SnapKV(budget=0.2)), 30, 6), (h2o_kv.H2O(heavy_ratio=0.1, recent_ratio=0.1), 50, 10)],
    ids=lambda x: x.describe() if isinstance(x, policies.Policy) else str(x),
)  # fmt: skip
def test_a_fraction_that_keeps_few_tokens_warns_once(policy, length, kept):
    caught = _prefill(policy, length)
    assert len(caught) == 1  # every layer fixes its budget; the user sees it once
    message = str(caught[0].message)
    assert f"keeps {kept} tokens per (sequence, KV head) of this {length}-token prompt" in message
    assert "token budget" in message


@pytest.mark.parametrize(
    "policy,length",
    [(h2o_kv.H2O(heavy=2, recent=2), 30), (h2o_kv.H2O(budget=0.5), 40), (h2o_kv.Local(window=0.4), 40),
     (h2o_kv.Full(), 30)],
    ids=lambda x: x.describe() if isinstance(x, policies.Policy) else str(x),
)  # fmt: skip
def test_token_budgets_enough_tokens_or_no_eviction_do_not_warn(policy, length):
    """A token budget is what the user asked for; 0.5 and 0.4 of 40 keep 20 and 16 (not under the floor)."""
    assert _prefill(policy, length) == []


def test_the_floor_rule():
    assert policies.short_fraction("H2O(budget=0.2)", policies.FRACTION_FLOOR - 1, 100) is not None
    assert policies.short_fraction("H2O(budget=0.2)", policies.FRACTION_FLOOR, 100) is None
    assert policies.short_fraction("H2O(budget=0.9)", 9, 9) is None  # keeps the whole prompt: nothing to warn

"""A policy's sizes follow one rule (docs/usage.md, "Budgets"): an int is tokens, a float in (0, 1] a fraction of the
prompt; anything else is refused at construction with a line naming the field."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv import policies
from h2o_kv.errors import BadBudget, UnknownPolicy


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: h2o_kv.H2O(heavy=-1, recent=8), "heavy must be >= 0"),
        (lambda: h2o_kv.H2O(heavy=0, recent=0), "must be > 0"),
        (lambda: h2o_kv.H2O(), "needs a size"),
        (lambda: h2o_kv.H2O(heavy=4, heavy_ratio=0.1), "not both"),
        (lambda: h2o_kv.H2O(heavy_ratio=1.5, recent_ratio=0.1), "fraction"),
        (lambda: h2o_kv.H2O(heavy_ratio=0.0, recent_ratio=0.0), "must be > 0"),
        (lambda: h2o_kv.H2O(budget=10, recent=20), "larger than budget"),
        (lambda: h2o_kv.H2O(budget=0, recent=0), "budget must be > 0"),
        (lambda: h2o_kv.Local(window=0), "window must be > 0"),
        (lambda: h2o_kv.StreamingLLM(sinks=-1, window=8), "sinks must be >= 0"),
        (lambda: h2o_kv.TOVA(budget=-5), "budget must be > 0"),
        (lambda: h2o_kv.KVCache(h2o_kv.Full(), mode="simulate"), "mode must be"),
        (lambda: h2o_kv.KVCache(h2o_kv.Full(), prefill_chunk=0), "prefill_chunk must be a positive int"),
        (lambda: h2o_kv.policies.build("h2o", 0), "must be in \\[1, "),
        (lambda: h2o_kv.policies.build("h2o", 1.5), "means nothing"),
        (lambda: h2o_kv.policies.build("local"), "needs a budget"),
        (lambda: h2o_kv.policies.build("full", 8), "takes no budget"),
        (lambda: h2o_kv.Local(window=2.5), "fraction of the prompt must be in"),
        (lambda: h2o_kv.policies.build("lru", 8), "unknown policy"),
    ],
)
def test_bad_budgets_raise(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_an_unknown_name_is_an_unknown_policy_naming_the_policy():
    with pytest.raises(UnknownPolicy, match="unknown policy 'lru'; choose from h2o, snapkv") as err:
        policies.build("lru", 1)
    assert err.value.param == "policy" and err.value.name == "lru" and err.value.choices == policies.NAMES
    with pytest.raises(UnknownPolicy):
        policies.policy_key("h2o-int4")


@pytest.mark.parametrize(
    "refuse, message",
    [
        (lambda: policies.build("h2o", 0), "must be in \\[1, "),
        (lambda: policies.build("h2o", 1.5), "means nothing"),
        (lambda: policies.build("local"), "policy 'local' needs a budget"),
        (lambda: policies.build("full", 8), "policy 'full' keeps every token and takes no budget"),
        (lambda: policies.parse_budget("lots"), "budget 'lots' is not a number"),
        (lambda: policies.parse_budget("150%"), "means nothing"),
        (lambda: policies.check_budget_value(0, "kv_budget"), "kv_budget as tokens must be in"),
    ],
)
def test_a_bad_budget_is_a_bad_budget_naming_the_budget(refuse, message):
    with pytest.raises(BadBudget, match=message) as err:
        refuse()
    assert err.value.param == "budget"


def test_non_integer_budget_is_a_type_error():
    with pytest.raises(TypeError, match="window must be an int"):
        h2o_kv.Local(window="8")
    with pytest.raises(TypeError, match="policy must be an h2o_kv policy"):
        h2o_kv.KVCache("h2o")


HUGE = 2**63


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda: h2o_kv.H2O(heavy=HUGE, recent=4), "heavy"),
        (lambda: h2o_kv.H2O(heavy=4, recent=HUGE), "recent"),
        (lambda: h2o_kv.H2O(budget=HUGE), "budget"),
        (lambda: h2o_kv.Local(window=HUGE), "window"),
        (lambda: h2o_kv.StreamingLLM(sinks=HUGE, window=4), "sinks"),
        (lambda: h2o_kv.StreamingLLM(sinks=4, window=HUGE), "window"),
        (lambda: h2o_kv.TOVA(budget=HUGE), "budget"),
        (lambda: policies.build("h2o", HUGE), "budget"),
    ],
)
def test_budgets_too_large_for_int64_are_refused_at_construction(build, name):
    with pytest.raises(ValueError, match=f"{name}.*at most|{name} as tokens must be in"):
        build()


@pytest.mark.parametrize("value", ["0.1", True, b"0.1", [0.1]])
@pytest.mark.parametrize("field", ["heavy_ratio", "recent_ratio"])
def test_ratio_fields_take_numbers_only_like_counts(field, value):
    other = "recent_ratio" if field == "heavy_ratio" else "heavy_ratio"
    with pytest.raises(TypeError, match=field):
        h2o_kv.H2O(**{field: value, other: 0.1})
    with pytest.raises(TypeError, match="heavy"):  # the same rule as the counts
        h2o_kv.H2O(heavy=value if value != "0.1" else "1", recent=1)


def test_h2o_with_a_budget_alone_splits_it_and_a_missing_size_is_named():
    assert h2o_kv.H2O(budget=16).capacity(torch.tensor([[[100]]])).item() == 16
    assert [int(t) for t in h2o_kv.H2O(budget=16).split(torch.tensor([[[100]]]))] == [8, 8]
    with pytest.raises(ValueError, match=r"H2O needs a size: H2O\(heavy=64, recent=64\)"):
        h2o_kv.H2O()

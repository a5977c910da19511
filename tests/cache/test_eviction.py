"""One cache layer against the literal reading of docs/eviction.md (tests/reference.py), on random tensors."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.cache.layer import KVLayer, Settings

from helpers import POLICIES, SCHEDULES, causal_mask, kept_positions, random_qkv, run_layer
from reference import reference_layer


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", ["drop", "mask"])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernels"])
def test_layer_matches_reference(name, schedule, mode, native):
    policy, capacity, params = POLICIES[name]
    q, k, v = random_qkv()
    chunks = SCHEDULES[schedule]
    out, layer = run_layer(policy, q, k, v, chunks, mode=mode, native=native)  # native: the C++ kernels' steps
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], chunks, name, capacity, params)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept
    assert all(len(head) == capacity for head in ref_kept)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prefill_chunk_option_equals_separate_calls(name):
    policy, capacity, params = POLICIES[name]
    q, k, v = random_qkv(seed=3)
    out, layer = run_layer(policy, q, k, v, [16], prefill_chunk=3)
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], [3, 3, 3, 3, 3, 1], name, capacity, params)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept
    assert layer.keys.shape[2] <= capacity + 3  # storage bounded by capacity + chunk


def test_heads_keep_different_tokens():
    q, k, v = random_qkv(kv_heads=2, seed=5)
    _, layer = run_layer(h2o_kv.H2O(heavy=4, recent=1), q, k, v, [16])
    kept = kept_positions(layer)
    assert kept[0] != kept[1]  # eviction is per KV head


@pytest.mark.parametrize("kv_heads", [1, 4])  # MQA and plain multi-head
def test_group_sizes(kv_heads):
    q, k, v = random_qkv(kv_heads=kv_heads, seed=7)
    out, layer = run_layer(h2o_kv.H2O(heavy=3, recent=2), q, k, v, [9, 1, 1, 1, 1, 1, 1, 1])
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], [9] + [1] * 7, "h2o", 5, {"recent": 2})
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


def test_left_padded_rows_match_single_rows():
    q, k, v = random_qkv(batch=2, seed=11)
    real = torch.ones(2, 16, dtype=torch.bool)
    real[1, :6] = False  # row 1: 6 padding columns, then 10 tokens
    chunks = [8, 1, 3, 1, 1, 1, 1]
    out, layer = run_layer(h2o_kv.H2O(heavy=3, recent=2), q, k, v, chunks, real=real)
    ref0, kept0 = reference_layer(q[0], k[0], v[0], chunks, "h2o", 5, {"recent": 2})
    torch.testing.assert_close(out[0].double(), ref0, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer, 0) == kept0
    row_chunks = [2, 1, 3, 1, 1, 1, 1]  # the same calls with the padding columns removed
    ref1, kept1 = reference_layer(q[1, :, 6:], k[1, :, 6:], v[1, :, 6:], row_chunks, "h2o", 5, {"recent": 2})
    torch.testing.assert_close(out[1, 6:].double(), ref1, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer, 1) == [[p for p in head] for head in kept1]


def test_sliding_window_layer_drops_tokens_outside_the_window():
    q, k, v = random_qkv(seed=13)
    out, layer = run_layer(h2o_kv.H2O(heavy=3, recent=2), q, k, v, [6, 1, 1, 1, 7], window=4)
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], [6, 1, 1, 1, 7], "h2o", 5, {"recent": 2}, window=4)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


@pytest.mark.parametrize("policy", [h2o_kv.H2O(heavy=4, recent=4), h2o_kv.Full()], ids=["h2o", "full"])
def test_a_window_smaller_than_the_budget_frees_the_prompts_storage(policy):
    """A sliding layer whose window keeps fewer tokens than the budget shrinks its storage after a prompt."""
    q, k, v = random_qkv(total=24, seed=13)
    out, layer = run_layer(policy, q, k, v, [20, 1, 1, 1, 1], window=4)
    rule = "full" if policy == h2o_kv.Full() else "h2o"
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], [20, 1, 1, 1, 1], rule, 8, {"recent": 4}, window=4)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept
    assert layer.keys.shape[2] <= 4 + 1


def test_ratio_budget_fixed_by_the_prompt():
    q, k, v = random_qkv(total=24, seed=17)
    policy = h2o_kv.H2O(heavy_ratio=0.25, recent_ratio=0.25)  # prompt of 16 -> heavy 4, recent 4
    _, layer = run_layer(policy, q, k, v, [16] + [1] * 8)
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], [16] + [1] * 8, "h2o", 8, {"recent": 4})
    assert kept_positions(layer) == ref_kept
    assert layer.max_capacity == 8


def test_scores_accumulate_in_float32_and_are_forgotten_on_eviction():
    q, k, v = random_qkv(seed=19)
    _, layer = run_layer(h2o_kv.H2O(heavy=3, recent=2), q, k, v, [1] * 16)
    assert layer.score.dtype == torch.float32
    assert torch.all(layer.score[layer.pos < 0] == 0)
    # every kept token's score is the attention it received: bounded by queries x group heads seen
    assert torch.all(layer.score[layer.pos >= 0] > 0)


def test_per_prompt_values_are_computed_once_per_layer_and_batch():
    """A decode step evicts in every layer: an H2O split is computed once, again only when the rows change."""
    splits = []

    class CountingH2O(h2o_kv.H2O):
        def split(self, prompt_len):
            splits.append(prompt_len.shape[0])
            return super().split(prompt_len)

    q, k, v = random_qkv(batch=2, total=24, seed=23)
    layer = KVLayer(Settings(CountingH2O(budget=0.5)), 0)
    mask = causal_mask(torch.ones(2, 12, dtype=torch.bool))
    layer.update(k[:, :, :12], v[:, :, :12])
    layer.forward_attention(q[:, :, :12], mask, scaling=0.125)
    ranked = len(splits)  # the settings' and the budget's capacity, and the prompt's eviction
    for t in range(12, 18):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        layer.forward_attention(q[:, :, t : t + 1], None, scaling=0.125)
    assert len(splits) == ranked and layer.vacant is not None
    layer.select_rows(torch.tensor([1]))
    for t in range(18, 21):
        layer.update(k[1:, :, t : t + 1], v[1:, :, t : t + 1])
        layer.forward_attention(q[1:, :, t : t + 1], None, scaling=0.125)
    assert splits[ranked:] == [1]  # the new batch's split, once
    assert int(layer.kept().max()) == 6

"""One cache layer against the literal reading of docs/eviction.md (tests/reference.py), on random tensors."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.cache.layer import KVLayer, Settings
from h2o_kv.cache.pooled import PooledKVLayer

from reference import reference_layer

POLICIES = {
    "h2o": (h2o_kv.H2O(heavy=3, recent=2), 5, {"recent": 2}),
    "local": (h2o_kv.Local(window=4), 4, {}),
    "streaming": (h2o_kv.StreamingLLM(sinks=2, window=3), 5, {"sinks": 2}),
    "tova": (h2o_kv.TOVA(budget=4), 4, {}),
}
SCHEDULES = {
    "token_by_token": [1] * 16,
    "one_call": [16],
    "mixed": [7, 1, 1, 5, 1, 1],
}


def causal_mask(real: torch.Tensor) -> torch.Tensor:
    """[B, 1, n, n] boolean mask as transformers builds it for the new tokens of one call."""
    n = real.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=real.device).tril()
    return (causal[None] & real[:, None, :])[:, None]


def run_layer(policy, q, k, v, chunks, *, real=None, mode="drop", prefill_chunk=None, window=None, native=False):
    """Drive one cache layer the way a model's attention does: update, then attention (`native`: with
    h2o-kv's C++ kernels, as a KVCache on a CPU where they can be built)."""
    settings = Settings(policy, mode, prefill_chunk, compile_kernel=native)
    layer = (PooledKVLayer if policy.head_pooled else KVLayer)(settings, 0)
    batch, total = q.shape[0], q.shape[2]
    real = torch.ones(batch, total, dtype=torch.bool, device=q.device) if real is None else real
    outs, start = [], 0
    for size in chunks:
        stop = start + size
        layer.update(k[:, :, start:stop], v[:, :, start:stop])
        out = layer.forward_attention(
            q[:, :, start:stop], causal_mask(real[:, start:stop]), scaling=q.shape[-1] ** -0.5, window=window
        )
        outs.append(out)
        assert int(layer.kept().max()) <= max(layer.max_capacity or 10**9, 0)
        start = stop
    return torch.cat(outs, dim=1), layer


def kept_positions(layer, row: int = 0) -> list[list[int]]:
    pos = layer.pos[row]
    if layer.head is not None:  # a head-pooled layer: one row, each slot tagged with its KV head
        tags = layer.head[row, 0]
        return [sorted(int(p) for p in pos[0][(tags == h) & (pos[0] >= 0)]) for h in range(layer.kv_heads)]
    return [sorted(int(p) for p in head[head >= 0]) for head in pos]


def random_qkv(batch=1, total=16, q_heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, total, dim, generator=gen) * 2
    k = torch.randn(batch, kv_heads, total, dim, generator=gen) * 2
    v = torch.randn(batch, kv_heads, total, dim, generator=gen)
    return q, k, v


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

"""Per-layer budgets (LayerBudgets: PyramidKV's schedule, and sliding layers giving their budget to
full-attention layers): each layer applies its scaled policy exactly (literal reference), the mean
budget over layers is the uniform one, and the bytes follow the total."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import h2o_kv
from h2o_kv.cache.layer import KVLayer, Settings
from h2o_kv.policies import H2O, TOVA, Local, Sinks, SnapKV, StreamingLLM, build
from h2o_kv.policies.layers import LayerBudgets, scale_budget

from conftest import make_model, random_ids
from helpers import causal_mask, kept_positions, random_qkv
from reference import reference_layer

GEMMA_LIKE = SimpleNamespace(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
LLAMA_LIKE = SimpleNamespace(num_hidden_layers=4)


@pytest.mark.parametrize("schedule", ["pyramid", "global"])
@pytest.mark.parametrize("config", [GEMMA_LIKE, LLAMA_LIKE], ids=["mixed", "full"])
def test_shares_average_to_one(schedule, config):
    shares = LayerBudgets(SnapKV(budget=8), schedule).shares(config)
    assert len(shares) == config.num_hidden_layers
    assert sum(shares) / len(shares) == pytest.approx(1.0)
    assert all(s > 0 for s in shares)


def test_pyramid_falls_and_global_moves_budget_to_full_layers():
    pyramid = LayerBudgets(SnapKV(budget=8), "pyramid", beta=4.0).shares(LLAMA_LIKE)
    assert pyramid == sorted(pyramid, reverse=True) and pyramid[-1] == pytest.approx(0.25)
    glob = LayerBudgets(SnapKV(budget=8), "global", sliding_share=0.5).shares(GEMMA_LIKE)
    assert glob[:5] == [0.5] * 5 and glob[5] == pytest.approx(6 - 2.5)
    assert LayerBudgets(SnapKV(budget=8), "global").shares(LLAMA_LIKE) == [1.0] * 4  # nothing to move


@pytest.mark.parametrize(
    "policy, expected",
    [
        (SnapKV(budget=10), SnapKV(budget=25)),
        (SnapKV(budget=0.2), SnapKV(budget=0.5)),
        (SnapKV(budget=0.6), SnapKV(budget=1.0)),  # at most the whole prompt
        (H2O(heavy=4, recent=2), H2O(heavy=10, recent=5)),
        (Local(window=4), Local(window=10)),
        (TOVA(budget=4), TOVA(budget=10)),
        (StreamingLLM(sinks=2, window=4), StreamingLLM(sinks=2, window=10)),
        (Sinks(SnapKV(budget=10), sinks=2), Sinks(SnapKV(budget=25), sinks=2)),
    ],
)
def test_scale_budget(policy, expected):
    assert scale_budget(policy, 2.5) == expected


@pytest.mark.parametrize("layer_idx", range(6))
@pytest.mark.parametrize(
    "chunks", [[16], [10, 1, 1, 1, 1, 1, 1], [1] * 16], ids=["one_call", "prompt_then_decode", "token_by_token"]
)
def test_each_layer_matches_the_reference_at_its_own_budget(layer_idx, chunks):
    policy = LayerBudgets(SnapKV(budget=6, window=4, pool=3), "global", sliding_share=0.5)
    capacity = scale_budget(policy.inner, policy.shares(GEMMA_LIKE)[layer_idx]).budget
    q, k, v = random_qkv(seed=3)
    layer = KVLayer(Settings(policy), layer_idx)
    outs, start = [], 0
    for size in chunks:
        layer.update(k[:, :, start : start + size], v[:, :, start : start + size])
        outs.append(
            layer.forward_attention(
                q[:, :, start : start + size], causal_mask(torch.ones(1, size, dtype=torch.bool)),
                scaling=q.shape[-1] ** -0.5, config=GEMMA_LIKE,
            )
        )  # fmt: skip
        start += size
    params = {"recent": min(4, capacity - capacity // 2), "observe": 4, "pool": 3}
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], chunks, "snapkv", capacity, params)
    torch.testing.assert_close(torch.cat(outs, dim=1)[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept
    assert max(len(head) for head in ref_kept) == min(capacity, 16)


def test_a_model_keeps_each_layers_share_in_the_same_bytes():
    """Tiny Gemma 3 (two sliding layers with a window of 6, one full layer): with the "global" schedule
    the full layer keeps more, the sliding ones less, and the cache holds as many bytes as the uniform split."""
    model, ids = make_model("gemma3"), random_ids(2, 40)
    uniform, layered = SnapKV(budget=4), LayerBudgets(SnapKV(budget=4), "global", sliding_share=0.5)
    assert layered.shares(model.config) == [0.5, 0.5, 2.0]
    caches = [h2o_kv.KVCache(p) for p in (uniform, layered)]
    with torch.no_grad():
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True)
    assert caches[0].kept_per_head().amax((1, 2)).tolist() == [4, 4, 4]
    assert caches[1].kept_per_head().amax((1, 2)).tolist() == [2, 2, 8]  # 0.5 x 4 in each sliding layer, 2 x 4
    assert caches[1].nbytes() == caches[0].nbytes()  # capacity + 1 slots per layer: 5 x 3 = 3 + 3 + 9


def test_builder_and_bad_options():
    assert build("pyramidkv", 0.2) == LayerBudgets(SnapKV(budget=0.2), "pyramid")
    assert build("globalkv", 64) == LayerBudgets(SnapKV(budget=64), "global")
    with pytest.raises(ValueError, match="schedule"):
        LayerBudgets(SnapKV(budget=8), "triangle")
    with pytest.raises(ValueError, match="sliding_share"):
        LayerBudgets(SnapKV(budget=8), "global", sliding_share=1.5)
    with pytest.raises(TypeError, match="wraps one"):
        LayerBudgets(LayerBudgets(SnapKV(budget=8)))
    with pytest.raises(ValueError, match="beta"):
        LayerBudgets(SnapKV(budget=8), "pyramid", beta=0.5)
    with pytest.raises(ValueError, match="sliding_share"):
        LayerBudgets(SnapKV(budget=8), "global", sliding_share=float("nan"))

    class Unsized(h2o_kv.Policy):  # a policy with no budget field cannot be scaled per layer
        pass

    with pytest.raises(TypeError, match="cannot scale the budget"):
        LayerBudgets(Unsized())


def test_engine_batches_per_layer_budgets_like_solo_runs():
    """Sequences with per-layer budgets join and leave a running batch (append_rows / select_rows) and
    get exactly their solo tokens, on a model with sliding and full layers."""
    from h2o_kv.runtime.engine import Engine

    from conftest import make_tokenizer

    engine = Engine(make_model("gemma3"), make_tokenizer(), policy="globalkv", budget=0.5, prefill_chunk=8)
    prompts = [random_ids(1, 12 + 5 * i, seed=i)[0].tolist() for i in range(4)]
    solo = [engine.generate(ids, max_tokens=6).token_ids for ids in prompts]
    handles = [engine.submit(ids, max_tokens=6) for ids in prompts]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert engine.kv_bytes_in_use() == 0


@pytest.mark.parametrize("budget", [7, 0.3])  # 7 tokens: the layers' rounded shares sum to more than 3 x 7
@pytest.mark.parametrize("schedule", ["globalkv", "pyramidkv"])
def test_engine_admission_counts_each_layers_own_slots(schedule, budget):
    """A request's admission size covers what its cache really holds with per-layer budgets (each layer
    rounds its own share), and exceeds it by less than one slot per layer."""
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.runtime.generation import forward

    from conftest import make_tokenizer

    model = make_model("gemma3")
    engine = Engine(model, make_tokenizer(), policy=schedule, budget=budget)
    policy, config = engine.resolve_policy(), model.config
    prompt, new = 37, 6
    reserved = engine.kv_bytes_for(prompt, new, policy)
    cache, peak = h2o_kv.KVCache(policy), 0
    with torch.no_grad():
        tokens = random_ids(1, prompt)
        for _ in range(new):
            tokens = forward(model, cache, tokens).argmax(-1, keepdim=True)
            peak = max(peak, cache.nbytes())
    layers = config.num_hidden_layers
    per_layer_slot = engine._count.layout // layers
    exact = sum(
        min(int(policy.for_layer(i, config).capacity(torch.tensor([prompt]))), prompt + new) + 1 for i in range(layers)
    )
    assert peak <= exact * per_layer_slot <= reserved < (exact + layers) * per_layer_slot

"""Policies beyond the paper's H2O (SnapKV scoring, decay, age normalisation, protected sinks) against the
literal reference of docs/eviction.md, and through a real model."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.policies import AdaKV, Sinks, SnapKV, build

from conftest import make_model, random_ids
from helpers import BEYOND as POLICIES
from helpers import BEYOND_SCHEDULES as SCHEDULES
from helpers import kept_positions, random_qkv, run_layer
from reference import reference_layer


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", ["drop", "mask"])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernels"])
def test_layer_matches_reference(name, schedule, mode, native):
    policy, rule, capacity, params = POLICIES[name]
    q, k, v = random_qkv(seed=3)
    chunks = SCHEDULES[schedule]
    out, layer = run_layer(policy, q, k, v, chunks, mode=mode, native=native)  # native: the C++ kernels' steps
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], chunks, rule, capacity, params)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


def test_observation_window_changes_what_a_prompt_keeps():
    """Only the last queries rank the prompt: a different set than H2O's all-query scores."""
    q, k, v = random_qkv(total=32, seed=5)
    _, snap = run_layer(SnapKV(budget=8, window=4, pool=1), q, k, v, [32])
    _, h2o = run_layer(h2o_kv.H2O(heavy=4, recent=4), q, k, v, [32])
    assert kept_positions(snap) != kept_positions(h2o)


def test_sinks_are_never_evicted():
    q, k, v = random_qkv(total=24, seed=2)
    _, layer = run_layer(Sinks(h2o_kv.Local(window=5), sinks=3), q, k, v, [1] * 24)
    assert all(len(head) == 5 and head[:3] == [0, 1, 2] for head in kept_positions(layer))


@pytest.mark.parametrize("policy", [SnapKV(budget=64), Sinks(SnapKV(budget=64)), h2o_kv.H2O(budget=64, decay=0.99)])
def test_budget_above_length_leaves_the_model_unchanged(policy):
    stock, model = make_model("llama", enable=False), make_model("llama")
    ids = random_ids(2, 20)
    with torch.no_grad():
        expected = stock(ids).logits
        got = model(ids, past_key_values=h2o_kv.KVCache(policy), use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_builder_names_and_bad_options():
    assert build("snapkv", 0.2) == SnapKV(budget=0.2)
    for bad, message in [
        (lambda: SnapKV(budget=8, pool=4), "pool must be odd"),
        (lambda: SnapKV(budget=1.5), "fraction"),
        (lambda: h2o_kv.H2O(budget=8, decay=0.0), "decay"),
        (lambda: Sinks(h2o_kv.Local(window=4), sinks=0), "sinks must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            bad()
    with pytest.raises(TypeError, match="Sinks wraps one"):
        Sinks("h2o")


def test_adakv_heads_share_the_layer_budget_in_the_memory_of_a_uniform_one():
    """AdaKV keeps heads x budget tokens per layer, split unevenly by score, in a uniform policy's bytes."""
    model, ids = make_model("llama"), random_ids(2, 48)
    uniform, pooled = h2o_kv.KVCache(SnapKV(budget=8)), h2o_kv.KVCache(AdaKV(SnapKV(budget=8)))
    with torch.no_grad():
        for cache in (uniform, pooled):
            model(ids, past_key_values=cache, use_cache=True)
            model(ids[:, :1], past_key_values=cache, use_cache=True)  # one decode step: add, then evict
    kept = pooled.kept_per_head()  # [layers, batch, kv heads]
    heads = kept.shape[-1]
    assert heads > 1 and bool((kept.sum(-1) == 8 * heads).all())
    assert int(kept.max()) > 8 and int(kept.min()) < 8  # the heads did not get equal shares
    assert bool((uniform.kept_per_head() == 8).all())
    tags = sum(layer.head.numel() for layer in pooled.layers)  # one int8 head tag per slot
    assert pooled.nbytes() == uniform.nbytes() + tags


@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("name, tied", [("adakv_h2o", False), ("adakv_tova", False), ("adakv_tova", True)])
def test_adakv_steady_decode_path_keeps_the_reference_tokens(name, tied, native, monkeypatch):
    """Once every row frees its `heads` slots each step, AdaKV's layer takes its steady decode path (counted);
    with tied priorities at the boundary (TOVA, zero keys) torch's ops follow the exact order in the step itself
    (`lowest_in_order`), and h2o-kv's C++ pass falls back to the general path. Both keep the reference's tokens,
    row by row of a batch whose rows got different prompts, with torch's ops and with h2o-kv's C++ kernels (the
    pooled attention, and `native.lowest_slots` for the eviction)."""
    from h2o_kv.cache.pooled import PooledKVLayer

    calls = {"steady": 0, "tie": 0}
    steady, evict_row = PooledKVLayer._decode_full, PooledKVLayer._evict_row

    def counted_steady(self, *args, **kwargs):
        calls["steady"] += 1
        return steady(self, *args, **kwargs)

    def counted_row(self, *args, **kwargs):
        freed = evict_row(self, *args, **kwargs)
        calls["tie"] += not freed
        return freed

    monkeypatch.setattr(PooledKVLayer, "_decode_full", counted_steady)
    monkeypatch.setattr(PooledKVLayer, "_evict_row", counted_row)
    from h2o_kv.backends import native as kernels

    lowest, kernel_calls = kernels.lowest_slots, []
    monkeypatch.setattr(kernels, "lowest_slots", lambda *a: kernel_calls.append(1) or lowest(*a))
    policy, rule, capacity, params = POLICIES[name]
    q, k, v = random_qkv(batch=2, total=40, seed=7)
    if tied:  # every other key zero: those tokens tie in TOVA's priorities (the last query's attention)
        k[:, :, ::2] = 0.0
    chunks = [12] + [1] * 28
    out, layer = run_layer(policy, q, k, v, chunks, native=native)
    for row in range(2):
        ref_out, ref_kept = reference_layer(q[row], k[row], v[row], chunks, rule, capacity, params)
        torch.testing.assert_close(out[row].double(), ref_out, atol=1e-5, rtol=1e-5)
        assert kept_positions(layer, row) == ref_kept
    fallback = tied and native  # a tie's step takes the general path, and so does the next
    assert calls["steady"] >= (5 if fallback else 20)
    assert bool(kernel_calls) == native
    assert (calls["tie"] > 0) == fallback


def test_adakv_refuses_what_means_nothing():
    with pytest.raises(TypeError, match="AdaKV wraps one"):
        AdaKV("snapkv")
    with pytest.raises(ValueError, match="shared=True"):
        AdaKV(SnapKV(budget=8, shared=True))
    assert build("adakv", 0.2) == AdaKV(SnapKV(budget=0.2))


def test_adakv_decodes_through_the_pooled_kernel_with_the_eager_results(arch, monkeypatch):
    """Where h2o-kv's C++ kernels can be built (here), AdaKV's head-pooled layers decode through
    native.pooled_attend_one, and once full through native.pooled_decode_step (both counted), with the eager
    path's logits and kept tokens (compile_kernel=False)."""
    from h2o_kv.backends import native

    calls = []
    for name in ("pooled_attend_one", "pooled_decode_step"):
        kernel = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *a, kernel=kernel, name=name, **k: calls.append(name) or kernel(*a, **k)
        )
    model, ids = make_model(arch), random_ids(2, 40)
    policy = AdaKV(h2o_kv.H2O(heavy=6, recent=4))
    caches = h2o_kv.KVCache(policy, compile_kernel=False), h2o_kv.KVCache(policy)
    logits = []
    with torch.no_grad():
        for cache in caches:
            steps = [model(ids[:, :20], past_key_values=cache, use_cache=True).logits]
            steps += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(20, 40)]
            logits.append(torch.cat(steps, dim=1))
            assert bool(calls) == (cache is caches[1])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    assert len(calls) >= 20 and "pooled_decode_step" in calls
    for a, b in zip(caches[1].layers, caches[0].layers):
        assert torch.equal(a.pos.sort(-1).values, b.pos.sort(-1).values)

"""Whole models (tiny, random, one per architecture) with the cache: the docs/eviction.md consequences."""

from __future__ import annotations

import pytest
import torch

import h2o_kv

from conftest import make_model, random_ids
from helpers import BIG, SMALL, check_left_padded_batch, decode


@pytest.mark.parametrize("policy", BIG, ids=lambda p: p.describe())
def test_budget_above_length_gives_the_unmodified_logits(arch, policy):
    ids = random_ids(2, 40)
    with torch.no_grad():
        expected = make_model(arch, enable=False)(ids).logits
    got = decode(make_model(arch), ids, h2o_kv.KVCache(policy), prefill=25)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", SMALL, ids=lambda p: p.describe())
def test_chunk1_prefill_equals_token_by_token_equals_mask(arch, policy):
    model, ids = make_model(arch), random_ids(1, 30)
    one_call_chunked = h2o_kv.KVCache(policy, prefill_chunk=1)
    stepwise = h2o_kv.KVCache(policy)
    masked = h2o_kv.KVCache(policy, mode="mask", prefill_chunk=1)
    with torch.no_grad():
        a = model(ids, past_key_values=one_call_chunked, use_cache=True).logits
        b = decode(model, ids, stepwise, prefill=1)
        c = model(ids, past_key_values=masked, use_cache=True).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)
    for la, lb, lc in zip(one_call_chunked.layers, stepwise.layers, masked.layers):
        kept = [torch.sort(layer.pos[layer.pos >= 0].view(*layer.pos.shape[:2], -1)).values for layer in (la, lb, lc)]
        assert torch.equal(kept[0], kept[1]) and torch.equal(kept[0], kept[2])
    assert masked.nbytes() > stepwise.nbytes()  # the simulation keeps evicted tokens in memory


def test_one_chunk_prefill_is_unmasked_then_evicted(arch):
    model, ids = make_model(arch), random_ids(1, 30)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad():
        expected = make_model(arch, enable=False)(ids).logits
        got = model(ids, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)  # the whole prompt attends unmasked
    assert cache.kept_tokens == 8 and cache.seen_tokens == 30


@pytest.mark.parametrize("policy", [*SMALL, h2o_kv.Full()], ids=lambda p: p.describe())
def test_left_padded_batch_equals_single_runs(arch, policy):
    check_left_padded_batch(make_model(arch), policy)


def test_kept_never_exceeds_capacity_and_memory_stays_flat():
    model = make_model("llama")
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=16, recent=16))
    token = random_ids(2, 20)
    sizes = []
    with torch.no_grad():
        out = model(token, past_key_values=cache, use_cache=True)
        for _ in range(1100):
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, past_key_values=cache, use_cache=True)
            assert int(cache.kept_per_head().max()) <= 32
            sizes.append(cache.nbytes())
    assert cache.seen_tokens == 1120 and cache.kept_tokens == 32
    assert len(set(sizes[20:])) == 1  # storage is a fixed size once the cache is full
    layer = cache.layers[0]
    assert layer.keys.shape[2] == 33  # capacity + the incoming token's slot


def test_generate_1000_tokens_keeps_bytes_flat():
    model = make_model("qwen2")
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=8, recent=8))
    with torch.no_grad():
        model(random_ids(1, 5), past_key_values=h2o_kv.KVCache(h2o_kv.Full()), use_cache=True)  # warm
        prompt = random_ids(1, 40)
        model.generate(prompt, past_key_values=cache, max_new_tokens=1, do_sample=False)
        after_prefill = cache.nbytes()
        cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=8, recent=8))
        model.generate(prompt, past_key_values=cache, max_new_tokens=1000, do_sample=False)
    assert cache.seen_tokens == 1039 and cache.kept_tokens == 16
    assert cache.nbytes() == after_prefill


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_every_architecture_generates(arch, sample):
    model = make_model(arch)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=6, recent=6))
    torch.manual_seed(0)
    out = model.generate(random_ids(2, 20), past_key_values=cache, max_new_tokens=20, do_sample=sample)
    assert out.shape == (2, 40)
    assert cache.kept_tokens <= 12 and cache.seen_tokens == 39


def test_mixed_sliding_and_global_layers():
    """Gemma 3: sliding layers hold at most their window, global layers the policy's capacity."""
    model = make_model("gemma3")  # sliding_window=6 on layers 0-1, full attention on layer 2
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=8, recent=8))
    with torch.no_grad():
        model.generate(random_ids(1, 30), past_key_values=cache, max_new_tokens=10, do_sample=False)
    kept = cache.kept_per_head().amax(dim=(1, 2)).tolist()
    assert kept == [5, 5, 16]


def test_stock_cache_still_works_on_an_enabled_model(llama):
    ids = random_ids(1, 20)
    with torch.no_grad():
        expected = make_model("llama", enable=False)(ids).logits
        torch.testing.assert_close(llama(ids).logits, expected, atol=1e-5, rtol=1e-4)
        out = llama.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 25)


def test_transformers_prefill_chunking_equals_our_option(llama):
    ids, policy = random_ids(1, 30), h2o_kv.H2O(heavy=4, recent=4)
    with torch.no_grad():
        ours = llama.generate(ids, past_key_values=h2o_kv.KVCache(policy, prefill_chunk=8), max_new_tokens=10)
        theirs = llama.generate(ids, past_key_values=h2o_kv.KVCache(policy), max_new_tokens=10, prefill_chunk_size=8)
    assert torch.equal(ours, theirs)


def test_beam_search_and_multiple_samples(llama):
    ids = random_ids(1, 30)
    with torch.no_grad():
        full = llama.generate(ids, past_key_values=h2o_kv.KVCache(h2o_kv.Full()), max_new_tokens=10, num_beams=3)
        stock = make_model("llama", enable=False).generate(ids, max_new_tokens=10, num_beams=3)
        assert torch.equal(full, stock)
        cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
        out = llama.generate(ids, past_key_values=cache, max_new_tokens=10, num_return_sequences=3, do_sample=True)
    assert out.shape == (3, 40) and cache.kept_tokens == 8 and cache.layers[0].keys.shape[0] == 3


def test_a_stale_handoff_does_not_leak_into_another_cache(llama):
    """A KVCache update whose attention never ran must not hijack a later forward with a stock cache."""
    ids = random_ids(1, 10)
    cache = h2o_kv.KVCache(h2o_kv.Full())
    h2o_kv.cache.attention.mark_forward(1, 1)  # as an enabled model's forward does before its first layer
    cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)  # pending hand-off, never consumed
    with torch.no_grad():
        expected = make_model("llama", enable=False)(ids).logits
        torch.testing.assert_close(llama(ids).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcapped"])
def test_forward_last_logits_equal_the_models_own(arch, softcap):
    """`generation.forward` gives the model's own last-token logits, soft-capped heads included."""
    from h2o_kv.runtime.generation import forward

    model = make_model(arch)
    if softcap is not None:
        if not hasattr(model.config, "final_logit_softcapping"):
            pytest.skip("this architecture has no logit soft-capping")
        model.config.final_logit_softcapping = softcap
    ids = random_ids(3, 12)
    mine, theirs = h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3)), h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3))
    with torch.no_grad():
        for piece in (ids[:, :10], ids[:, 10:11], ids[:, 11:12]):
            got = forward(model, mine, piece)
            expected = model(piece, past_key_values=theirs, use_cache=True).logits[:, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


STEADY = [h2o_kv.H2O(heavy=4, recent=4), h2o_kv.TOVA(budget=8), h2o_kv.SnapKV(budget=8)]


@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("policy", STEADY, ids=lambda p: p.describe())
def test_steady_decode_path_equals_the_general_one(arch, policy, native, monkeypatch):
    """Once a layer is full, a decode step takes `KVLayer._decode_full`: torch's operations without mask or count
    once packed, or with the C++ kernels and a policy ranking by score with the newest kept (H2O, SnapKV) one
    `native.decode_step` pass per row (counted); the general path gives the same logits and keeps the same
    tokens in the same slots."""
    from h2o_kv.backends import native as native_mod

    calls = []
    fused = native_mod.decode_step
    monkeypatch.setattr(native_mod, "decode_step", lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs))
    model, ids = make_model(arch), random_ids(2, 30)
    steady = h2o_kv.KVCache(policy, compile_kernel=native)
    got = decode(model, ids, steady, prefill=12)
    in_kernel = native and type(policy).protected_recent is not h2o_kv.policies.Policy.protected_recent
    if in_kernel:
        assert len(calls) >= 10  # most decode steps (a sliding layer's take the general path)
    else:
        assert not calls and any(layer.packed for layer in steady.layers)  # the packed step was taken
    monkeypatch.setattr(h2o_kv.cache.layer.KVLayer, "_full", lambda self: False)
    general = h2o_kv.KVCache(policy, compile_kernel=native)
    calls.clear()
    expected = decode(model, ids, general, prefill=12)
    assert not calls and not any(layer.packed for layer in general.layers)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    for a, b in zip(steady.layers, general.layers):
        assert torch.equal(a.pos, b.pos)
        torch.testing.assert_close(a.score, b.score)

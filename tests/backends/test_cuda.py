"""The cache on an accelerator: the same semantics as on the CPU, checked where a GPU is present.

Skipped without CUDA (CI has none). `H2O_KV_TEST_DEVICE` names another device (e.g. ``cpu``, to read these
tests' logic on a machine without one). On CUDA the C++ kernels are never used: these are the torch paths.
"""

from __future__ import annotations

import os

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.engine import Engine

from conftest import make_model, make_tokenizer, random_ids
from helpers import (
    BIG,
    INT8_TOLERANCE,
    SCHEDULES,
    SMALL,
    check_left_padded_batch,
    decode,
    kept_positions,
    random_qkv,
    run_layer,
)
from helpers import POLICIES as LAYER_POLICIES
from reference import reference_layer

DEVICE = torch.device(os.environ.get("H2O_KV_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device here (set H2O_KV_TEST_DEVICE)"
)


def on_device(arch: str, enable: bool = True) -> torch.nn.Module:
    return make_model(arch, enable=enable).to(DEVICE)


@pytest.mark.parametrize("name", sorted(LAYER_POLICIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_layer_matches_reference(name, schedule, mode):
    policy, capacity, params = LAYER_POLICIES[name]
    q, k, v = (t.to(DEVICE) for t in random_qkv())
    chunks = SCHEDULES[schedule]
    out, layer = run_layer(policy, q, k, v, chunks, mode=mode)
    assert out.device.type == DEVICE.type and layer.keys.device.type == DEVICE.type
    ref_out, ref_kept = reference_layer(q[0].cpu(), k[0].cpu(), v[0].cpu(), chunks, name, capacity, params)
    torch.testing.assert_close(out[0].cpu().double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


@pytest.mark.parametrize("policy", BIG, ids=lambda p: p.describe())
def test_budget_above_length_gives_the_unmodified_logits(arch, policy):
    ids = random_ids(2, 40).to(DEVICE)
    with torch.no_grad():
        expected = on_device(arch, enable=False)(ids).logits
    got = decode(on_device(arch), ids, h2o_kv.KVCache(policy), prefill=25)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["float32", "int8"])
@pytest.mark.parametrize("policy", SMALL, ids=lambda p: p.describe())
def test_evicting_cache_equals_the_cpu_run(arch, policy, kv_dtype):
    """Bounded caches on the device keep the tokens the CPU run keeps and give its logits (int8: to a quantization
    step, since a value on a rounding boundary may round the other way after the device's last-bit differences)."""
    ids = random_ids(2, 40)
    cpu_cache, dev_cache = h2o_kv.KVCache(policy, kv_dtype=kv_dtype), h2o_kv.KVCache(policy, kv_dtype=kv_dtype)
    expected = decode(make_model(arch), ids, cpu_cache, prefill=20)
    got = decode(on_device(arch), ids.to(DEVICE), dev_cache, prefill=20)
    torch.testing.assert_close(got.cpu(), expected, **(INT8_TOLERANCE if kv_dtype else dict(atol=1e-4, rtol=1e-4)))
    assert dev_cache.nbytes() == cpu_cache.nbytes() and dev_cache.kept_tokens == cpu_cache.kept_tokens
    for a, b in zip(dev_cache.layers, cpu_cache.layers):
        assert a.keys.device.type == DEVICE.type
        assert torch.equal(a.pos.cpu().sort(-1).values, b.pos.sort(-1).values)


@pytest.mark.parametrize("policy", [*SMALL, h2o_kv.Full()], ids=lambda p: p.describe())
def test_left_padded_batch_equals_single_runs(policy):
    check_left_padded_batch(on_device("llama"), policy, atol=1e-4)


def test_bfloat16_cache_gives_the_stock_logits_in_half_the_kv_bytes():
    ids = random_ids(2, 40).to(DEVICE)
    stock = on_device("llama", enable=False).to(torch.bfloat16)
    model = on_device("llama").to(torch.bfloat16)
    full_bf16, full_f32 = h2o_kv.KVCache(h2o_kv.Full()), h2o_kv.KVCache(h2o_kv.Full())
    with torch.no_grad():
        expected = stock(ids).logits.float()
        decode(on_device("llama"), ids, full_f32, prefill=25)
    got = decode(model, ids, full_bf16, prefill=25).float()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    assert full_bf16.layers[0].keys.dtype == torch.bfloat16
    kv = [sum(layer.keys.nbytes + layer.values.nbytes for layer in c.layers) for c in (full_bf16, full_f32)]
    assert kv[0] * 2 == kv[1] and full_bf16.nbytes() < full_f32.nbytes()


def test_device_memory_stays_flat_while_decoding():
    """Real eviction on the device: after the cache fills, allocated device memory does not grow with tokens."""
    model = on_device("llama")
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=16, recent=16))
    allocated = []
    with torch.no_grad():
        out = model(random_ids(2, 20).to(DEVICE), past_key_values=cache, use_cache=True)
        for _ in range(300):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            if DEVICE.type == "cuda":
                allocated.append(torch.cuda.memory_allocated(DEVICE))
    assert cache.seen_tokens == 320 and cache.kept_tokens == 32
    assert cache.layers[0].keys.shape[2] == 33
    if allocated:
        assert max(allocated[50:]) <= allocated[50]


def test_engine_concurrent_requests_equal_solo_runs():
    from test_engine import SPECS, prompt

    engine = Engine(on_device("llama"), make_tokenizer(), max_batch=16, prefill_chunk=16)
    requests = [(prompt(10 + 7 * i, seed=i), SPECS[i % len(SPECS)]) for i in range(12)]
    solo = [engine.generate(ids, max_tokens=10, **spec).token_ids for ids, spec in requests]
    handles = [engine.submit(ids, max_tokens=10, **spec) for ids, spec in requests]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo
    assert engine.kv_bytes_in_use() == 0


def test_engine_int8_requests_equal_solo_runs():
    engine = Engine(on_device("qwen2"), make_tokenizer(), max_batch=8, prefill_chunk=16, kv_dtype="int8")
    prompts = [random_ids(1, 12 + 5 * i, seed=i)[0].tolist() for i in range(5)]
    solo = [engine.generate(ids, max_tokens=8, policy="h2o", budget=10).token_ids for ids in prompts]
    handles = [engine.submit(ids, max_tokens=8, policy="h2o", budget=10) for ids in prompts]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo

"""AdaKV's head-pooled rows (cache/pooled.py) on the Triton decode kernel: against literal attention with each
query head masked to its own KV head's slots, every AdaKV policy of the eviction matrix against the literal
reference, and a model's decode steps against the torch ones. On a CPU under Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.backends import interpreted, triton_importable
from h2o_kv.cache.quant import dequantize, quantize

from conftest import make_model, random_ids
from helpers import BEYOND as POLICIES
from helpers import BEYOND_SCHEDULES as SCHEDULES
from helpers import kept_positions, random_qkv, run_layer
from reference import reference_layer

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed (the dev extra has it)")
INTERPRETED = pytest.mark.skipif(not interpreted(), reason="CPU tensors reach Triton's kernels only interpreted")
DEVICES = (["cpu"] if interpreted() else []) + (["cuda"] if torch.cuda.is_available() else [])
ADAKV = sorted(name for name in POLICIES if name.startswith("adakv"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["float32", "int8"])
@pytest.mark.parametrize("kv_heads,group,holes", [(2, 2, True), (3, 1, False), (4, 3, True)])
def test_pooled_row_matches_literal_attention_per_head(device, storage, kv_heads, group, holes):
    """Query head i attends only over the slots tagged i // group; the summed probabilities are each slot's own
    group's, `last` their mean over that group."""
    from h2o_kv.backends.triton_decode import decode_attend

    gen = torch.Generator().manual_seed(kv_heads * 10 + group)
    batch, slots, dim = 2, 70, 16
    q = torch.randn(batch, kv_heads * group, 1, dim, generator=gen) * 2
    k, v = torch.randn(2, batch, 1, slots, dim, generator=gen)
    head = torch.randint(0, kv_heads, (batch, 1, slots), generator=gen, dtype=torch.int64)
    head[..., :kv_heads] = torch.arange(kv_heads)  # every head holds a token
    pos = torch.randint(-1 if holes else 0, 90, (batch, 1, slots), generator=gen)
    pos[..., :kv_heads] = 3
    k_ref, v_ref, scales = k, v, (None, None)
    if storage == "int8":
        (k, ks), (v, vs) = quantize(k), quantize(v)
        k_ref, v_ref, scales = dequantize(k, ks, torch.float32), dequantize(v, vs, torch.float32), (ks, vs)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, scores, last = decode_attend(to(q), to(k), to(v), to(pos) if holes else None, scaling=dim**-0.5,
                                      key_scale=to(scales[0]), value_scale=to(scales[1]), want_scores=True,
                                      want_last=True, slot_head=to(head.to(torch.int8)), kv_heads=kv_heads)  # fmt: skip
    out, scores, last = out.cpu(), scores.cpu(), last.cpu()
    own = head[:, 0, None, :] == (torch.arange(kv_heads * group) // group)[None, :, None]  # [B, Hq, S]
    visible = own & (pos >= 0) if holes else own
    logits = (q[:, :, 0].double() @ k_ref[:, 0].double().mT) * dim**-0.5
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    torch.testing.assert_close(out[:, 0].double(), probs @ v_ref[:, 0].double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores[:, 0].double(), probs.sum(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last[:, 0].double(), probs.sum(1) / group, atol=1e-5, rtol=1e-5)


@INTERPRETED
def test_a_pooled_row_must_be_one_storage_row():
    from h2o_kv.backends.triton_decode import decode_attend

    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="one storage row"):
        decode_attend(q, k, k, None, scaling=0.25, slot_head=torch.zeros(1, 2, 8, dtype=torch.int8), kv_heads=2)


@INTERPRETED
@pytest.mark.parametrize("name", ADAKV)
@pytest.mark.parametrize("schedule,mode", [(schedule, "drop") for schedule in sorted(SCHEDULES)] + [("mixed", "mask")])
def test_adakv_layer_on_the_triton_kernel_matches_the_reference(monkeypatch, name, schedule, mode):
    """Every AdaKV policy and schedule of tests/policies/test_policies_beyond.py (drop mode; mask mode once: the
    interpreter is slow) with the decode steps' attention on the Triton kernel (counted: with each slot's head)."""
    from h2o_kv.backends import triton_decode

    monkeypatch.setenv("H2O_KV_TRITON", "1")
    real, pooled_calls = triton_decode.decode_attend, []
    monkeypatch.setattr(triton_decode, "decode_attend", lambda *a, **kw: pooled_calls.append(
        kw.get("slot_head") is not None) or real(*a, **kw))  # fmt: skip
    policy, rule, capacity, params = POLICIES[name]
    q, k, v = random_qkv(dim=16, seed=3)
    chunks = SCHEDULES[schedule]
    out, layer = run_layer(policy, q, k, v, chunks, mode=mode)
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], chunks, rule, capacity, params)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept
    assert len(pooled_calls) == sum(size == 1 for size in chunks)  # every one-token call
    assert all(pooled_calls[1:]) and sum(size == 1 for size in chunks[1:]) <= sum(pooled_calls)  # over the pooled row


@INTERPRETED
def test_adakv_decode_steps_on_the_triton_kernel_equal_the_torch_steps(monkeypatch):
    """A model's AdaKV cache decoding past its budget, attention on the Triton kernel against torch's: the logits and
    the kept positions."""
    model, ids = make_model("llama"), random_ids(2, 30)
    runs = []
    for triton in ("0", "1"):
        monkeypatch.setenv("H2O_KV_TRITON", triton)
        cache = h2o_kv.KVCache(h2o_kv.AdaKV(h2o_kv.H2O(heavy=4, recent=4)), compile_kernel=False)
        with torch.no_grad():
            steps = [model(ids[:, :14], past_key_values=cache, use_cache=True).logits]
            steps += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(14, 30)]
        runs.append((torch.cat(steps, 1), [kept_positions(layer, row) for layer in cache.layers for row in (0, 1)]))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-4, rtol=1e-4)
    assert runs[1][1] == runs[0][1]

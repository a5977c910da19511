"""The attention kernel's fast paths against its blocked path (which the literal reference tests cover)."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

import h2o_kv
from h2o_kv.cache import attend as kernel
from h2o_kv.cache import routes
from h2o_kv.cache.routes import Call, Slots

from helpers import POLICIES, kept_positions, random_qkv, run_layer, slots
from reference import reference_layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "new_from,extra,window",
    [(0, 0, None), (0, 5, None), (12, 3, None), (0, 5, 7)],
    ids=["prompt", "reserved", "after-old", "sliding"],
)
@pytest.mark.parametrize(
    "want_scores,want_last,score_from",
    [(True, False, 8), (False, True, 0), (True, True, 29), (False, False, 0)],
    ids=["window", "last", "window+last", "output"],
)
def test_prompt_path_equals_the_blocked_path(dtype, new_from, extra, window, want_scores, want_last, score_from):
    """SDPA for the output and `attend` on the scoring queries only give the blocked path's results."""
    n, batch, q_heads, kv_heads, dim = 30, 2, 6, 2, 16
    keys, values, pos = slots(batch, kv_heads, new_from, n, extra, dim, dtype)
    q = torch.randn(batch, q_heads, n, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    qpos = torch.arange(new_from, new_from + n).expand(batch, n)
    options = dict(scaling=0.25, window=window, want_scores=want_scores, want_last=want_last, score_from=score_from)
    with mock.patch.object(routes, "attend_prompt", wraps=routes.attend_prompt) as prompt_path:
        fast = routes.attend(q, Slots(keys, values, pos), qpos, Call(new_from=new_from, **options))
    assert prompt_path.call_count == 1
    blocked = routes.attend(q, Slots(keys, values, pos), qpos, Call(new_from=None, **options))  # the general path
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[0].float(), blocked[0].float(), **tol)
    for got, want in zip(fast[1:], blocked[1:]):
        assert (got is None) == (want is None)
        if got is not None:  # scores and last attention are float32 either way
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        dict(score_from=0, want_scores=True),  # H2O: every query scores, no shortcut
        dict(score_from=30, want_scores=True),  # no query scores
        dict(window=8),  # a sliding layer after old slots (whose slots need not hold their positions)
        dict(softcap=30.0),
        dict(holes=True),  # an old slot is empty: the general path masks it
    ],
    ids=["all-score", "none-score", "window", "softcap", "holes"],
)
def test_prompt_path_is_not_taken_where_it_does_not_apply(case):
    keys, values, pos = slots(1, 2, 6, 30, 0, 16, torch.float32)
    if case.pop("holes", False):
        pos[0, 0, 2] = -1
    q = torch.randn(1, 4, 30, 16)
    qpos = torch.arange(6, 36).view(1, 30)
    with mock.patch.object(routes, "attend_prompt", wraps=routes.attend_prompt) as prompt_path:
        routes.attend(q, Slots(keys, values, pos), qpos, Call(scaling=0.25, new_from=6, **case))
    assert prompt_path.call_count == 0


@pytest.mark.parametrize("name", ["local", "streaming", "tova"])
def test_policies_without_prompt_scores_take_the_prompt_path_and_match_the_reference(name):
    """A prompt in one call (then decoding): the policies that need no prompt-wide attention use SDPA,
    and the layer still matches the literal reference."""
    policy, capacity, params = POLICIES[name]
    q, k, v = random_qkv(seed=29)
    with mock.patch.object(routes, "attend_prompt", wraps=routes.attend_prompt) as prompt_path:
        out, layer = run_layer(policy, q, k, v, [10, 1, 1, 1, 1, 1, 1])
    assert prompt_path.call_count == 1
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], [10, 1, 1, 1, 1, 1, 1], name, capacity, params)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)


def blocked(q, kv, qpos, call):
    """`attend_prompt`'s job done by `attend`'s general path (new_from=None: every query masked by position)."""
    return routes.attend(q, kv, qpos, replace(call, new_from=None))


@pytest.mark.parametrize("chunks", [[20, 1, 1, 1, 1], [6, 6, 8, 1, 1]], ids=["one-call", "chunks"])
def test_snapkv_keeps_the_same_tokens_through_the_prompt_path(chunks):
    """SnapKV ranks a prompt (or chunk) by its last `window` queries, so the rest needs no probabilities:
    the prompt path keeps the same tokens and gives the same outputs as the blocked path."""
    q, k, v = random_qkv(total=24, seed=31)
    policy = h2o_kv.SnapKV(budget=8, window=4)
    with mock.patch.object(routes, "attend_prompt", wraps=routes.attend_prompt) as prompt_path:
        fast, fast_layer = run_layer(policy, q, k, v, chunks)
    assert prompt_path.call_count >= 1
    with mock.patch.object(routes, "attend_prompt", side_effect=blocked):
        slow, slow_layer = run_layer(policy, q, k, v, chunks)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert kept_positions(fast_layer) == kept_positions(slow_layer)
    assert int(fast_layer.kept().max()) == 8


@pytest.mark.parametrize("n", [1, 12], ids=["decode", "prompt"])
@pytest.mark.parametrize("int8", [False, True], ids=["bf16-kv", "int8-kv"])
def test_bfloat16_on_a_cpu_without_native_products_computes_in_float32(n, int8, monkeypatch):
    """bfloat16 products are emulated on CPUs without AVX-512 BF16 or AMX (5-20x slower): the kernel upcasts
    to float32, so a bfloat16 call gives exactly the float32 call on the same (bfloat16) numbers, cast back."""
    monkeypatch.setattr(kernel, "native_products", lambda dtype: False)
    keys, values, pos = slots(2, 2, 12 - n, n, 3, 16, torch.bfloat16)
    q = torch.randn(2, 4, n, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    qpos = torch.arange(12 - n, 12).expand(2, n)
    call = Call(scaling=0.25, want_scores=True, new_from=12 - n if n > 1 else None)
    scales = {}
    if int8:
        (k8, v8), (ks, vs) = h2o_kv.cache.quant.quantize(torch.stack((keys, values)))
        scales = dict(key_scale=ks, value_scale=vs)
        keys, values = k8, v8
    work = torch.empty(keys.numel() + values.numel()) if n == 1 else None
    out, scores, _ = routes.attend(q, Slots(keys, values, pos, **scales, work=work), qpos, call)
    wide = (keys, values) if int8 else (keys.float(), values.float())
    ref, ref_scores, _ = routes.attend(q.float(), Slots(*wide, pos, **scales), qpos, call)
    assert out.dtype == torch.bfloat16 and kernel.compute_dtype(torch.bfloat16, q.device) == torch.float32
    assert torch.equal(out, ref.to(torch.bfloat16)) and torch.equal(scores, ref_scores)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16-kv", "int8-kv"])
def test_bfloat16_on_a_cpu_with_native_products_computes_in_bfloat16(int8, monkeypatch):
    """Where the CPU multiplies bfloat16 in hardware, the products stay in bfloat16 (int8 storage's kernel
    takes float32 queries): close to the float32 call on the same numbers, and not equal to it."""
    monkeypatch.setattr(kernel, "native_products", lambda dtype: True)
    keys, values, pos = slots(2, 2, 11, 1, 3, 16, torch.bfloat16)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    call, scales, native = Call(scaling=0.25, want_scores=True), {}, False
    if int8:
        (k8, v8), (ks, vs) = h2o_kv.cache.quant.quantize(torch.stack((keys, values)))
        scales, native = dict(key_scale=ks, value_scale=vs), True
        keys, values = k8, v8
    qpos = torch.full((2, 1), 11)
    out, scores, _ = routes.attend(q, Slots(keys, values, pos, **scales), qpos, call, native_kernels=native)
    wide = (keys, values) if int8 else (keys.float(), values.float())
    ref, ref_scores, _ = routes.attend(q.float(), Slots(*wide, pos, **scales), qpos, call, native_kernels=native)
    assert out.dtype == torch.bfloat16 and kernel.compute_dtype(torch.bfloat16, q.device) == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(scores, ref_scores, atol=2e-2, rtol=2e-2)
    if not int8:
        assert not torch.equal(scores, ref_scores)  # the logits really were computed in bfloat16


def test_a_bfloat16_layer_decodes_through_one_float32_buffer(monkeypatch):
    monkeypatch.setattr(kernel, "native_products", lambda dtype: False)
    q, k, v = (t.to(torch.bfloat16) for t in random_qkv(total=20, seed=37))
    out, layer = run_layer(h2o_kv.H2O(heavy=3, recent=2), q, k, v, [12] + [1] * 8)
    assert out.dtype == torch.bfloat16 and layer.keys.dtype == torch.bfloat16
    assert layer.settings._work is not None and layer.settings._work.dtype == torch.float32
    ref_out, ref_kept = reference_layer(q[0].float(), k[0].float(), v[0].float(), [12] + [1] * 8, "h2o", 5,
                                        {"recent": 2})  # fmt: skip
    assert kept_positions(layer) == ref_kept
    torch.testing.assert_close(out[0].double(), ref_out, atol=2e-2, rtol=2e-2)

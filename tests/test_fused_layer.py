"""fused_layer.py: a Llama decoder layer's decode step in two C++ calls, held to the stock model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import h2o_kv
from h2o_kv import fused_layer, native
from h2o_kv.fused_layer import FusedLlamaDecoderLayer, use_fused_layers
from h2o_kv.generation import forward
from h2o_kv.native import MAX_ROWS

from conftest import biased_llama, make_model, random_ids

pytestmark = pytest.mark.skipif(h2o_kv.native.missing() is not None, reason="h2o-kv's C++ kernels cannot be built")


def fused_calls(monkeypatch) -> list[bool]:
    """Records, for every call of a fused layer, whether it took the C++ step."""
    taken, fused = [], FusedLlamaDecoderLayer._fused
    monkeypatch.setattr(FusedLlamaDecoderLayer, "_fused", lambda self, *a: taken.append(fused(self, *a)) or taken[-1])
    return taken


CACHES = {
    "h2o": lambda model: h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4)),
    "h2o-int8": lambda model: h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4), kv_dtype="int8"),
    "dynamic": lambda model: DynamicCache(config=model.config),
    "static": lambda model: StaticCache(config=model.config, max_cache_len=32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("build", [lambda: make_model("llama"), biased_llama], ids=["llama", "biased"])
def test_decode_logits_equal_the_stock_model(build, cache, dtype, monkeypatch):
    """A prompt (3 x 22 rows, more than MAX_ROWS: the stock layer), then eight batch-3 decode steps through the
    C++ step (counted), every cache taking its own path between the two calls: the logits and kept tokens of
    the stock model."""
    stock, fused = build().to(dtype), build().to(dtype)
    assert use_fused_layers(fused) == 2
    taken = fused_calls(monkeypatch)
    prompt = MAX_ROWS // 3 + 1
    ids = random_ids(3, prompt + 8)
    caches = [CACHES[cache](stock), CACHES[cache](fused)]
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        for step, cols in enumerate([slice(0, prompt)] + [slice(t, t + 1) for t in range(prompt, prompt + 8)]):
            a = forward(stock, caches[0], ids[:, cols], all_logits=True)
            b = forward(fused, caches[1], ids[:, cols], all_logits=True)
            torch.testing.assert_close(b, a, **tolerance, msg=f"call {step}")
    assert taken == [False] * 2 + [True] * 16  # the prompt takes the stock layer, each decode step the C++ one
    if cache.startswith("h2o"):
        assert caches[0].kept_tokens == caches[1].kept_tokens == 8
        assert torch.equal(caches[0].kept_per_head(), caches[1].kept_per_head())


def test_swap_keeps_the_modules_and_swaps_llama_layers_only(arch):
    model = make_model(arch)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    children = [list(m.children()) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    swapped = use_fused_layers(model)
    assert swapped == (2 if arch == "llama" else 0)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # same tensors, same keys
    if swapped:
        assert all(type(layer) is FusedLlamaDecoderLayer for layer in model.base_model.layers)
        assert [list(layer.children()) for layer in model.base_model.layers] == children  # the same submodules
        assert not any(p.is_meta for p in model.parameters())
    assert use_fused_layers(model) == 0  # the second call swaps nothing


def test_hidden_states_and_generate_match_the_stock_model():
    """transformers' output capture (hooks on the layer class) sees the fused layers; generate's tokens are the same."""
    stock, fused = make_model("llama"), make_model("llama")
    use_fused_layers(fused)
    ids = random_ids(2, 10)
    with torch.no_grad():
        outs = []
        for model in (stock, fused):
            cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3))
            model(ids, past_key_values=cache)
            outs.append(model(ids[:, -1:], past_key_values=cache, output_hidden_states=True).hidden_states)
        assert len(outs[1]) == len(outs[0]) == 3
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
        run = dict(max_new_tokens=6, do_sample=False)
        cache = lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3))  # noqa: E731
        tokens = [m.generate(ids, past_key_values=cache(), **run) for m in (stock, fused)]
    assert torch.equal(tokens[0], tokens[1])


def test_what_the_step_cannot_take_goes_to_the_stock_layer(monkeypatch):
    """Gradients, a hook on a submodule and output_attentions take LlamaDecoderLayer.forward."""
    model = make_model("llama")
    use_fused_layers(model)
    taken = fused_calls(monkeypatch)
    prompt = MAX_ROWS // 2 + 1
    ids = random_ids(2, prompt + 1)
    with torch.no_grad():
        model(ids[:, :prompt], past_key_values=DynamicCache(config=model.config))  # more than MAX_ROWS rows: a prompt
    model.train()
    model(ids[:, prompt:], past_key_values=DynamicCache(config=model.config))  # training: gradients
    model.eval()
    seen = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        model(ids[:, prompt:], past_key_values=DynamicCache(config=model.config))
    hook.remove()
    assert seen == [1]  # the hook ran: that layer took the stock path
    with torch.no_grad():
        model(ids[:, prompt:], past_key_values=DynamicCache(config=model.config), output_attentions=True)
    assert taken == [False, False] + [False, False] + [True, False] + [False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner", [(4, 96), (3, 45)])  # 45 x 3: the last 135 % 16 of SiLU one by one
def test_layer_out_is_torchs_elementwise_ops_around_its_products(dtype, rows, inner):
    """layer_out: the residual, RMSNorm, SiLU(gate) x up and the last residual as torch computes them in the dtype,
    around the kernel's own products (native.rows_linear); in bfloat16 to the bit (rounding where torch rounds)."""
    native.load()
    torch.manual_seed(rows)
    hidden, eps = 40, 1e-5
    x, attn = torch.randn(rows, 1, hidden).to(dtype), torch.randn(rows, 1, hidden).to(dtype)
    wo, wd = (torch.randn(hidden, n).to(dtype) / 6 for n in (hidden, inner))
    wg, wu = (torch.randn(inner, hidden).to(dtype) * s for s in (0.8, 0.2))  # gates of a few units either side of 0
    norm = (1 + torch.randn(hidden) / 10).to(dtype)
    got = torch.ops.h2o_kv.layer_out(x, attn, wo, None, norm, eps, wg, None, wu, None, wd, None)
    linear = native.rows_linear
    h = x.view(rows, hidden) + linear(attn.view(rows, hidden), wo, None)
    hf = h.float()
    hn = norm * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)  # LlamaRMSNorm
    act = torch.nn.functional.silu(linear(hn, wg, None)) * linear(hn, wu, None)
    want = h + linear(act, wd, None)
    if dtype == torch.bfloat16:  # every step rounded as torch rounds it: the same bits
        assert torch.equal(got.view(rows, hidden), want)
    else:  # float32: the norm's sum in another order
        torch.testing.assert_close(got.view(rows, hidden), want, atol=1e-5, rtol=1e-5)


def test_the_kernel_refuses_what_it_cannot_read():
    x, w = torch.randn(1, 1, 8), torch.randn(8, 8)
    cos = sin = torch.randn(1, 1, 4)
    norm = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 hidden states"):
        torch.ops.h2o_kv.layer_in(x.double(), norm, 1e-6, w, None, w, None, w, None, cos, sin, 4)
    with pytest.raises(RuntimeError, match="weights contiguous"):
        torch.ops.h2o_kv.layer_in(x, norm, 1e-6, w.t(), None, w, None, w, None, cos, sin, 4)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        torch.ops.h2o_kv.layer_in(torch.randn(MAX_ROWS + 1, 1, 8), norm, 1e-6, w, None, w, None, w, None, cos, sin, 4)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.h2o_kv.layer_in(x, norm, 1e-6, w, None, w, None, w, None, cos[..., :2], sin[..., :2], 4)


def test_fusable_needs_a_stock_llama_layer():
    model = make_model("llama")
    layer = model.model.layers[0]
    assert fused_layer.fusable(layer)
    model.config.hidden_act = "gelu"
    assert not fused_layer.fusable(layer)

"""Weight-first linear layers (h2o_kv.rows_first): the same model, the same logits, a different product order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import h2o_kv
from h2o_kv import native
from h2o_kv.fused_layer import FusedLlamaDecoderLayer
from h2o_kv.generation import forward
from h2o_kv.rows_first import MAX_ROWS, RowsFirstLinear, use_rows_first

from conftest import make_model, random_ids


def plain_linears(model) -> int:
    return sum(type(m) is nn.Linear for m in model.base_model.modules())


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 5, 9, MAX_ROWS, MAX_ROWS + 1])
def test_rows_first_linear_equals_nn_linear(bias, rows, kernel):
    torch.manual_seed(0)
    stock = nn.Linear(48, 80, bias=bias)
    swapped = RowsFirstLinear(48, 80, bias=bias)
    swapped.load_state_dict(stock.state_dict())
    swapped.kernel = kernel
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        torch.testing.assert_close(swapped(x), stock(x), atol=1e-6, rtol=1e-5)
        assert swapped(x).shape == (rows, 1, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inputs,outputs", [(1, 48, 80), (4, 50, 13), (7, 576, 192), (16, 17, 6), (12, 3, 1)])
def test_rows_kernel_equals_the_float_product(rows, inputs, outputs, dtype):
    """native.rows_linear: x @ W^T + b summed in float32 and rounded once to the dtype, for row counts, input
    sizes off the vector width and output counts off the kernel's 4- and 2-row tiles."""
    torch.manual_seed(rows * inputs)
    x, w, b = torch.randn(rows, inputs), torch.randn(outputs, inputs), torch.randn(outputs)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for bias in (b, None):
        got = native.rows_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (rows, outputs)
        want = (expected if bias is not None else expected - b.double()).to(dtype)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_kernel_gives_a_row_the_same_numbers_in_any_batch(dtype):
    """Each output is one row against one weight row in a fixed order: bit-equal alone and in batches of 2-64
    (the tiles and passes differ by batch size), so batched requests get their solo tokens."""
    torch.manual_seed(0)
    x, w = torch.randn(MAX_ROWS, 203).to(dtype), torch.randn(70, 203).to(dtype)
    solo = torch.cat([native.rows_linear(x[i : i + 1], w, None) for i in range(MAX_ROWS)])
    for rows in (2, 3, 5, 8, 9, MAX_ROWS):
        assert torch.equal(native.rows_linear(x[:rows], w, None), solo[:rows]), rows


def test_rows_kernel_refuses_mixed_dtypes_and_shapes():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.rows_linear(x, w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="x \\[R, K\\], weight \\[N, K\\]"):
        native.rows_linear(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.rows_linear(x.double(), w.double(), None)


def test_swap_keeps_the_parameters_and_swaps_once(arch):
    model = make_model(arch)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    expected = plain_linears(model)
    assert expected > 0
    assert use_rows_first(model) == expected + 1  # and the output projection
    assert plain_linears(model) == 0
    assert sum(type(m) is RowsFirstLinear for m in model.base_model.modules()) == expected
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # same tensors, same keys
    head = model.get_output_embeddings()
    assert type(head) is RowsFirstLinear and head.kernel  # the kernel can be built here
    if model.config.tie_word_embeddings:
        assert head.weight is model.get_input_embeddings().weight
    assert use_rows_first(model) == 0


def test_compile_kernel_picks_the_product(monkeypatch):
    """compile_kernel=False keeps the torch product; True where the kernel cannot be built is one clear error."""
    model = make_model("llama")
    assert use_rows_first(model, compile_kernel=False) > 0
    assert not any(m.kernel for m in model.modules() if isinstance(m, RowsFirstLinear))
    with pytest.raises(TypeError, match="compile_kernel must be None, True or False"):
        use_rows_first(make_model("llama"), compile_kernel=1)
    monkeypatch.setattr(native, "missing", lambda: "ninja is not installed (pip install ninja)")
    with pytest.raises(RuntimeError, match="cannot be built here: ninja is not installed"):
        use_rows_first(make_model("llama"), compile_kernel=True)


def test_decode_logits_equal_the_stock_model(arch, monkeypatch):
    """Prefill (more rows than MAX_ROWS: the stock product) then batch-3 decode steps (the C++ kernel,
    counted), with the last token's logits through the swapped output projection too."""
    calls = []
    rows_linear = native.rows_linear
    monkeypatch.setattr(native, "rows_linear", lambda *a: calls.append(1) or rows_linear(*a))
    stock, swapped = make_model(arch), make_model(arch)
    use_rows_first(swapped)
    prompt = MAX_ROWS // 3 + 1  # 3 x prompt rows: more than MAX_ROWS
    ids = random_ids(3, prompt + 8)
    caches = [h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4)) for _ in range(2)]
    with torch.no_grad():
        for step, cols in enumerate([slice(0, prompt)] + [slice(t, t + 1) for t in range(prompt, prompt + 8)]):
            a = forward(stock, caches[0], ids[:, cols], all_logits=True)
            b = forward(swapped, caches[1], ids[:, cols], all_logits=True)
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"call {step}")
        last = forward(swapped, caches[1], ids[:, -1:])  # generation's decode call: the model's own head
        torch.testing.assert_close(last, forward(stock, caches[0], ids[:, -1:]), atol=2e-5, rtol=1e-4)
    assert caches[0].kept_tokens == caches[1].kept_tokens > 0
    fused = [m for m in swapped.modules() if isinstance(m, FusedLlamaDecoderLayer)]  # their products in one kernel
    inside = {id(m) for layer in fused for m in layer.modules()}
    layers = sum(type(m) is RowsFirstLinear and id(m) not in inside for m in swapped.base_model.modules())
    assert len(calls) == 9 * (layers + 1)  # nine decode calls of every other linear layer and the head
    assert bool(fused) == (arch == "llama")


def test_a_model_without_a_decoder_is_refused():
    with pytest.raises(ValueError, match="no decoder"):
        use_rows_first(nn.Sequential(nn.Linear(4, 4)))


def test_outputs_are_contiguous_like_nn_linear():
    """A transposed (W @ x^T)^T view would send SDPA to its slow math path: the output must be contiguous."""
    swapped = RowsFirstLinear(48, 80)
    with torch.no_grad():
        out = swapped(torch.randn(4, 1, 48))
    assert out.is_contiguous() and out.stride()[-1] == 1


def test_engine_with_rows_first_batches_like_solo_runs():
    """`h2o-kv serve --rows-first`: requests decoding together get their solo tokens (the product order
    is per row, whatever the batch)."""
    from h2o_kv.engine import Engine

    from conftest import make_tokenizer

    model = make_model("llama")
    assert use_rows_first(model) > 0
    engine = Engine(model, make_tokenizer(), policy="h2o", budget=0.5, max_batch=MAX_ROWS)
    prompts = [random_ids(1, 10 + 7 * i, seed=i)[0].tolist() for i in range(5)]
    solo = [engine.generate(ids, max_tokens=8).token_ids for ids in prompts]
    handles = [engine.submit(ids, max_tokens=8) for ids in prompts]
    engine.run()
    assert [h.result().token_ids for h in handles] == solo


def test_a_strided_weight_keeps_the_torch_product():
    """The kernel reads a contiguous weight; a transposed one would be copied every call, so it keeps the
    torch product (the same logits either way)."""
    model = make_model("llama")
    proj = model.model.layers[0].mlp.down_proj
    proj.weight = nn.Parameter(proj.weight.detach().t().contiguous().t())  # same values, transposed strides
    ids = random_ids(2, 12)

    def decode_step() -> torch.Tensor:  # a prompt (24 rows: the stock product), then one 2-row step
        cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
        forward(model, cache, ids[:, :11])
        return forward(model, cache, ids[:, 11:])

    with torch.no_grad():
        expected = decode_step()
        use_rows_first(model)
        got = decode_step()
    swapped = model.model.layers[0].mlp.down_proj
    assert type(swapped) is RowsFirstLinear and not swapped.kernel
    assert model.model.layers[0].mlp.up_proj.kernel
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)

"""Weight-first linear layers (h2o_kv.rows_first): the same model, the same logits, a different product order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import h2o_kv
from h2o_kv.generation import forward
from h2o_kv.rows_first import MAX_ROWS, RowsFirstLinear, use_rows_first

from conftest import make_model, random_ids


def plain_linears(model) -> int:
    return sum(type(m) is nn.Linear for m in model.base_model.modules())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1])
def test_rows_first_linear_equals_nn_linear(bias, rows):
    torch.manual_seed(0)
    stock = nn.Linear(48, 80, bias=bias)
    swapped = RowsFirstLinear(48, 80, bias=bias)
    swapped.load_state_dict(stock.state_dict())
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        torch.testing.assert_close(swapped(x), stock(x), atol=1e-6, rtol=1e-5)
        assert swapped(x).shape == (rows, 1, 80)


def test_swap_keeps_the_parameters_and_swaps_once(arch):
    model = make_model(arch)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    expected = plain_linears(model)
    assert expected > 0
    assert use_rows_first(model) == expected
    assert plain_linears(model) == 0
    assert sum(type(m) is RowsFirstLinear for m in model.base_model.modules()) == expected
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # same tensors, same keys
    head = model.get_output_embeddings()
    assert type(head) is nn.Linear  # the output projection is generation.forward's business
    assert use_rows_first(model) == 0


def test_decode_logits_equal_the_stock_model(arch):
    """Prefill (more rows than MAX_ROWS: the stock product) then batch-3 decode steps (weight-first)."""
    stock, swapped = make_model(arch), make_model(arch)
    use_rows_first(swapped)
    ids = random_ids(3, 24)
    caches = [h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4)) for _ in range(2)]
    with torch.no_grad():
        for step, cols in enumerate([slice(0, 16)] + [slice(t, t + 1) for t in range(16, 24)]):
            a = forward(stock, caches[0], ids[:, cols], all_logits=True)
            b = forward(swapped, caches[1], ids[:, cols], all_logits=True)
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"call {step}")
    assert caches[0].kept_tokens == caches[1].kept_tokens > 0


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

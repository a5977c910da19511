"""The real bundled model (SmolLM2-135M-Instruct, installed by `make setup`) and the CLI."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv import cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    try:
        return h2o_kv.load_model("smollm2-135m")
    except FileNotFoundError as err:  # pragma: no cover - only without `make setup`
        pytest.skip(str(err))


PROMPT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them."
)


def test_budget_above_length_matches_stock_sdpa(smollm):
    model, tokenizer = smollm
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=256, recent=256))
    with torch.no_grad():
        ours = [model(ids[:, :-8], past_key_values=cache, use_cache=True).logits]
        ours += [
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            for t in range(ids.shape[1] - 8, ids.shape[1])
        ]
        model.set_attn_implementation("sdpa")
        try:
            stock = model(ids).logits
        finally:
            h2o_kv.enable(model)
    # float32 through 30 layers, summed in another order (one call against a prompt then single tokens): about
    # 1e-5 relative per layer on logits of magnitude 10-30, so 1e-3 absolute; a wrong kept token moves them by >0.1
    torch.testing.assert_close(torch.cat(ours, dim=1), stock, atol=1e-3, rtol=1e-4)


def test_h2o_at_20_percent_generates_and_frees_memory(smollm):
    model, tokenizer = smollm
    inputs = tokenizer([PROMPT * 3], return_tensors="pt")
    full, h2o = h2o_kv.KVCache(h2o_kv.Full()), h2o_kv.KVCache(h2o_kv.H2O(heavy_ratio=0.1, recent_ratio=0.1))
    with torch.no_grad():
        for cache in (full, h2o):
            model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    prompt_len = inputs.input_ids.shape[1]
    budget = 2 * int(0.1 * prompt_len)
    assert h2o.kept_tokens == budget and full.kept_tokens == prompt_len + 11
    kv = lambda c: sum(layer.keys.nbytes + layer.values.nbytes for layer in c.layers)  # noqa: E731
    assert kv(h2o) == 30 * 2 * (budget + 1) * 3 * 64 * 4  # 30 layers, K and V, slots, 3 KV heads, dim 64, float32


def test_cli_generate_prints_cache_stats(capsys):
    argv = ["generate", "Name a colour.", "--model", "smollm2-135m", "--policy", "h2o", "--budget", "0.5"]
    assert cli.main([*argv, "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert "kept" in err and "KV cache" in err and "tokens/s" in err


def test_cli_demo_side_by_side(capsys):
    assert cli.main(["demo", "--model", "smollm2-135m", "--words", "120", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert cli.DEMO_QUESTION in out and "Full cache" in out and "h2o at 20% of the prompt" in out and "KV kept" in out


def test_cli_rejects_bad_flags_before_loading(capsys):
    assert cli.main(["generate", "hi", "--policy", "h2o", "--budget", "-1"]) == 2
    assert "budget as tokens must be in [1, " in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--model", "./missing-model"]) == 2
    assert "does not exist" in capsys.readouterr().err

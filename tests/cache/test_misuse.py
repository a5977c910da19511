"""Library edges found by trying h2o-kv as a new user would (issue 10): each one is refused with a clear line."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import h2o_kv
import h2o_kv.runtime.models
from h2o_kv import policies

from conftest import make_model, random_ids


def tiny_llama(layers: int = 2, hidden: int = 64, enable: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    model = tf.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return h2o_kv.enable(model) if enable else model


# -- a fraction budget must be sized from the whole prompt ---------------------------------------------


def test_fraction_budget_with_transformers_chunked_prefill_is_refused(llama):
    ids = random_ids(1, 80)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy_ratio=0.1, recent_ratio=0.1))
    with torch.no_grad(), pytest.raises(ValueError, match="prompt_len="):
        llama.generate(ids, past_key_values=cache, max_new_tokens=3, prefill_chunk_size=16)


@pytest.mark.parametrize("policy", [h2o_kv.H2O(heavy_ratio=0.1, recent_ratio=0.1), h2o_kv.H2O(budget=0.2)])
def test_fraction_budget_comes_from_the_whole_prompt(llama, policy):
    ids = random_ids(1, 80)
    with torch.no_grad():
        hinted = h2o_kv.KVCache(policy, prompt_len=80)
        chunked = llama.generate(ids, past_key_values=hinted, max_new_tokens=3, prefill_chunk_size=16)
        ours = h2o_kv.KVCache(policy, prefill_chunk=16)
        one_call = llama.generate(ids, past_key_values=ours, max_new_tokens=3)
    assert hinted.kept_tokens == ours.kept_tokens == 16  # 20 % of 80 tokens, not of the first 16-token chunk
    assert torch.equal(chunked, one_call)


def test_token_budgets_work_with_transformers_chunked_prefill(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad():
        llama.generate(random_ids(1, 80), past_key_values=cache, max_new_tokens=3, prefill_chunk_size=16)
    assert cache.kept_tokens == 8


def test_a_later_turn_after_decoding_keeps_the_fraction_fixed_by_the_prompt(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(budget=0.25))
    with torch.no_grad():
        llama(random_ids(1, 40), past_key_values=cache, use_cache=True)
        llama(random_ids(1, 1), past_key_values=cache, use_cache=True)
        llama(random_ids(1, 20, seed=2), past_key_values=cache, use_cache=True)  # the next turn of a chat
    assert cache.kept_tokens == 10


# -- budgets --------------------------------------------------------------------------------------------


def test_largest_budget_still_works(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=policies.MAX_TOKENS, recent=policies.MAX_TOKENS))
    with torch.no_grad():
        llama(random_ids(1, 12), past_key_values=cache, use_cache=True)
    assert cache.kept_tokens == 12


# -- one cache, one model, one batch --------------------------------------------------------------------


def _filled_cache(model, length=20):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad():
        model(random_ids(1, length), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize(
    "other",
    [lambda: make_model("gemma3"), lambda: tiny_llama(hidden=128), lambda: tiny_llama(layers=3)],
    ids=["kv_heads", "head_size", "more_layers"],
)
def test_a_cache_used_by_another_model_is_refused(llama, other):
    cache = _filled_cache(llama)
    with torch.no_grad(), pytest.raises(ValueError, match="a cache belongs to one model and one batch"):
        other()(random_ids(1, 3), past_key_values=cache, use_cache=True)


def test_a_cache_used_by_a_model_with_fewer_layers_is_refused_on_the_next_call(llama):
    cache = _filled_cache(llama)
    smaller = tiny_llama(layers=1)
    with torch.no_grad():
        smaller(random_ids(1, 3), past_key_values=cache, use_cache=True)  # cannot be told apart yet
        with pytest.raises(ValueError, match="reached 1 of this KVCache's 2 layers"):
            llama(random_ids(1, 1), past_key_values=cache, use_cache=True)


def test_a_cache_reused_for_an_unrelated_shorter_prompt_is_refused(llama):
    cache = _filled_cache(llama, length=40)
    with torch.no_grad(), pytest.raises(ValueError, match="use a new KVCache for an unrelated prompt"):
        llama.generate(random_ids(1, 20, seed=3), past_key_values=cache, max_new_tokens=3)


def test_a_cache_in_another_dtype_is_refused(llama):
    cache = _filled_cache(llama)
    with torch.no_grad(), pytest.raises(ValueError, match="filled by another model"):
        llama.to(torch.bfloat16)(random_ids(1, 1), past_key_values=cache, use_cache=True)


def test_one_layer_model_without_enable_is_refused_on_its_first_call():
    model = tiny_llama(layers=1, enable=False)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad(), pytest.raises(RuntimeError, match="call h2o_kv.enable"):
        model(random_ids(1, 8), past_key_values=cache, use_cache=True)


def test_one_layer_model_with_enable_works():
    model = tiny_llama(layers=1)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad():
        model.generate(random_ids(1, 12), past_key_values=cache, max_new_tokens=4)
    assert cache.kept_tokens == 8 and cache.seen_tokens == 15


# -- padding, attention weights, assisted decoding ------------------------------------------------------


@pytest.mark.parametrize("calls", [[10], [6, 4]], ids=["one_call", "two_calls"])
def test_right_padding_is_refused(llama, calls):
    ids, mask = random_ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # row 1: 7 tokens then padding on the right
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad(), pytest.raises(ValueError, match="pad.* on the left"):
        start = 0
        for size in calls:
            stop = start + size
            llama(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache, use_cache=True)
            start = stop


def test_left_padding_in_several_calls_is_accepted(llama):
    ids, mask = random_ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :7] = 0  # row 1: the whole first call is padding
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=2, recent=2))
    with torch.no_grad():
        llama(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
        llama(ids[:, 6:], attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.layers[0].next_pos.view(-1).tolist() == [10, 3]


def test_output_attentions_is_refused(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions=True is not supported"):
        llama(random_ids(1, 8), past_key_values=cache, use_cache=True, output_attentions=True)


@pytest.mark.parametrize(
    "extra",
    [lambda: {"assistant_model": make_model("llama", seed=1)}, lambda: {"prompt_lookup_num_tokens": 3}],
    ids=["assistant_model", "prompt_lookup"],
)
def test_assisted_decoding_is_refused(llama, extra):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad(), pytest.raises(ValueError, match="assisted decoding"):
        llama.generate(random_ids(1, 20), past_key_values=cache, max_new_tokens=5, **extra())


# -- loading ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, message", [("meta", "holds no weights"), ("tpu9", "device"), ("quantum", "device")])
def test_load_model_refuses_devices_that_cannot_hold_a_model(device, message, monkeypatch):
    monkeypatch.setattr(
        h2o_kv.runtime.models, "_resolve", lambda name: pytest.fail("resolved a model for a bad device")
    )
    with pytest.raises(ValueError, match=message):
        h2o_kv.load_model("smollm2-135m", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_load_model_refuses_cuda_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        h2o_kv.load_model("smollm2-135m", device="cuda")


def test_hub_id_without_network_is_refused_at_once(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(FileNotFoundError, match="not available offline .*127.0.0.1:9 unreachable"):
        h2o_kv.load_model("someone/some-model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        h2o_kv.load_model("someone/some-model")

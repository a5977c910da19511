"""Bad input gets a clear error and changes nothing."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import h2o_kv

from conftest import make_model, random_ids


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: h2o_kv.H2O(heavy=-1, recent=8), "heavy must be >= 0"),
        (lambda: h2o_kv.H2O(heavy=0, recent=0), "must be > 0"),
        (lambda: h2o_kv.H2O(), "needs a size"),
        (lambda: h2o_kv.H2O(heavy=4, heavy_ratio=0.1), "not both"),
        (lambda: h2o_kv.H2O(heavy_ratio=1.5, recent_ratio=0.1), "fraction"),
        (lambda: h2o_kv.H2O(heavy_ratio=0.0, recent_ratio=0.0), "must be > 0"),
        (lambda: h2o_kv.H2O(budget=10, recent=20), "larger than budget"),
        (lambda: h2o_kv.H2O(budget=0, recent=0), "budget must be > 0"),
        (lambda: h2o_kv.Local(window=0), "window must be > 0"),
        (lambda: h2o_kv.StreamingLLM(sinks=-1, window=8), "sinks must be >= 0"),
        (lambda: h2o_kv.TOVA(budget=-5), "budget must be > 0"),
        (lambda: h2o_kv.KVCache(h2o_kv.Full(), mode="simulate"), "mode must be"),
        (lambda: h2o_kv.KVCache(h2o_kv.Full(), prefill_chunk=0), "prefill_chunk must be a positive int"),
        (lambda: h2o_kv.policies.build("h2o", 0), "must be in \\[1, "),
        (lambda: h2o_kv.policies.build("h2o", 1.5), "means nothing"),
        (lambda: h2o_kv.policies.build("local"), "needs a budget"),
        (lambda: h2o_kv.policies.build("full", 8), "takes no budget"),
        (lambda: h2o_kv.Local(window=2.5), "fraction of the prompt must be in"),
        (lambda: h2o_kv.policies.build("lru", 8), "unknown policy"),
    ],
)
def test_bad_budgets_raise(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_non_integer_budget_is_a_type_error():
    with pytest.raises(TypeError, match="window must be an int"):
        h2o_kv.Local(window="8")
    with pytest.raises(TypeError, match="policy must be an h2o_kv policy"):
        h2o_kv.KVCache("h2o")


def test_cache_reused_for_another_batch_size_raises_and_keeps_its_state(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with torch.no_grad():
        llama(random_ids(2, 12), past_key_values=cache, use_cache=True)
        before = [layer.pos.clone() for layer in cache.layers], cache.seen_tokens, cache.get_seq_length()
        with pytest.raises(ValueError, match="holds 2 sequences but got a batch of 3"):
            llama(random_ids(3, 1), past_key_values=cache, use_cache=True)
        assert cache.seen_tokens == before[1] and cache.get_seq_length() == before[2]
        assert all(torch.equal(a, layer.pos) for a, layer in zip(before[0], cache.layers))
        llama(random_ids(2, 1), past_key_values=cache, use_cache=True)  # still usable for its own batch
    assert cache.seen_tokens == 13


def test_attention_without_scores_is_refused():
    model = make_model("llama", enable=False)  # stock SDPA: no attention probabilities to score with
    with torch.no_grad(), pytest.raises(RuntimeError, match="call h2o_kv.enable"):
        model(random_ids(1, 8), past_key_values=h2o_kv.KVCache(h2o_kv.H2O(heavy=2, recent=2)), use_cache=True)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: tf.MambaForCausalLM(tf.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1)),
            "AttentionInterface",
        ),
        (
            lambda: tf.T5ForConditionalGeneration(
                tf.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
            ),
            "encoder-decoder",
        ),
    ],
    ids=["mamba", "t5"],
)
def test_unsupported_architectures_are_refused_unchanged(build, message):
    model = build()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        h2o_kv.enable(model)
    assert model.config._attn_implementation == before


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        h2o_kv.load_model("./no/such/model")

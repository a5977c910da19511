"""Bad input gets a clear error and changes nothing."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import h2o_kv

from conftest import make_model, random_ids


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

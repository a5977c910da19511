"""Positions past the model's context are refused (engine, server, CLI) or warned about once (a KVCache used
directly): a bounded cache bounds memory, not the positions the model reads."""

from __future__ import annotations

import warnings

import pytest
import torch

import h2o_kv
from h2o_kv.errors import ContextTooLong
from h2o_kv.runtime.engine import Engine
from h2o_kv.runtime.generation import decode_step, prefill

from conftest import make_model, make_tokenizer, random_ids


@pytest.mark.parametrize("policy,budget", [("h2o", 0.2), ("snapkv", 16), ("full", None)])
def test_the_engine_refuses_a_request_past_the_context_whatever_its_cache(policy, budget):
    model = make_model("llama")
    model.config.max_position_embeddings = 64
    engine = Engine(model, make_tokenizer())
    past = r"prompt \(60 tokens\) \+ max_tokens \(8\) exceed the model's context of 64"
    with pytest.raises(ContextTooLong, match=past):
        engine.submit(random_ids(1, 60)[0].tolist(), max_tokens=8, policy=policy, budget=budget)
    assert engine.stats()["waiting"] == 0
    ok = engine.submit(random_ids(1, 56)[0].tolist(), max_tokens=8, policy=policy, budget=budget, ignore_eos=True)
    engine.run()
    assert ok.result().completion_tokens == 8


def test_a_cache_used_directly_warns_once_when_it_goes_past_the_context():
    model = make_model("llama")
    model.config.max_position_embeddings = 24
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = prefill(model, cache, random_ids(1, 20))
        assert not [w for w in caught if "context" in str(w.message)]
        for position in range(20, 30):
            logits = decode_step(model, cache, logits.argmax(-1), torch.tensor([position]))
    past = [str(w.message) for w in caught if "past the model's context" in str(w.message)]
    assert past == ["this KVCache's sequence reached position 25, past the model's context of 24 tokens: the model "
                    "was not trained there and its output degrades whatever the cache keeps"]  # fmt: skip

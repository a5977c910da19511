"""Qwen2.5-Coder-0.5B-Instruct, joined from its pinned part packages (`make setup`): it loads offline with its chat
template, answers, stops at its end token, and under a bounded cache keeps what the budget says."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.bundled import QWEN_EOS, installed
from h2o_kv.runtime.models import load_model

NAME = "qwen2.5-coder-0.5b"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not installed(NAME), reason=f"{NAME} is installed by make setup")]


@pytest.fixture(scope="module")
def qwen():
    return load_model(NAME)


def test_answers_with_its_chat_template_and_stops_at_its_end_token(qwen):
    model, tokenizer = qwen
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=16, recent=16))
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=16, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)
    assert int(new[-1]) in QWEN_EOS and len(new) < 16  # it ended the answer itself
    assert cache.kept_tokens == 32

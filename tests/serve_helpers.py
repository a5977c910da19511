"""Shared by the serve tests: a tiny random Llama with the bundled tokenizer's vocabulary, an engine
and app served on 127.0.0.1 at an ephemeral port, and readers for /metrics."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
import transformers as tf

import h2o_kv

MODEL = "tiny"
CONTEXT = 1024


def bundled_tokenizer():
    """The bundled model's tokenizer (it has a chat template); skips when `make setup` has not run."""
    from h2o_kv.runtime.models import _resolve, bundled_gguf_path

    try:
        bundled_gguf_path("smollm2-135m")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    tok = tf.AutoTokenizer.from_pretrained(_resolve("smollm2-135m"))
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    return tok


def tiny_model(tokenizer, seed: int = 0, context: int = CONTEXT) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
    )
    return h2o_kv.enable(tf.LlamaForCausalLM(cfg).eval())


@contextmanager
def running_server(model, tokenizer, *, drain_timeout: float = 2.0, api_keys=(), **engine_kwargs):
    """(engine, base URL) of a server on an ephemeral loopback port (`api_keys`: the keys it requires), stopped on
    exit."""
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.runtime.serve.app import create_app
    from h2o_kv.runtime.serve.server import serve_in_thread

    engine = Engine(model, tokenizer, **engine_kwargs)
    with serve_in_thread(create_app(engine, MODEL, api_keys=api_keys), engine, drain_timeout=drain_timeout) as url:
        yield engine, url


def client(url: str, timeout: float = 60.0):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout)


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of /metrics (0.0 when the labelled series does not exist yet)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(sample.labels.get(k) == v for k, v in labels.items())):
                return sample.value
    return 0.0


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)

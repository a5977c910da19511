"""What the GPU study's cells share: the model shapes, the budget, random-weight models, timing and an h2o-kv
cache brought to its budget (h2o_kv/studies/bench/gpu.py)."""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                      rope_theta=500000.0, max_position_embeddings=131072),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False,
                 rope_theta=10000.0, max_position_embeddings=4096),
}  # fmt: skip
BUDGET = 0.2


def make_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device, fn) -> float:
    """Seconds `fn()` takes, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def copy_rate(device: torch.device, nbytes: int) -> float:
    """Bytes read plus written per second by a large device-to-device copy (the bandwidth floor's rate)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(clock(device, lambda: dst.copy_(src)) for _ in range(10))
    return 2 * nbytes / seconds


def h2o_cache(model, name: str, budget: int, prompt_len: int, batch: int, device, kv_dtype=None, chunk=None):
    """A KVCache of `name` (h2o or snapkv) at `budget` tokens, prefilled with a random prompt (in calls of `chunk`
    tokens, as the engine reads a prompt, if given); (cache, prefill s, the greedy next token)."""
    from h2o_kv import KVCache, enable
    from h2o_kv.policies import build
    from h2o_kv.runtime.generation import prefill

    enable(model)
    cache = KVCache(build(name, budget), kv_dtype=kv_dtype)
    ids = torch.randint(model.config.vocab_size, (batch, prompt_len), device=device)
    box = {}
    seconds = clock(device, lambda: box.update(logits=prefill(model, cache, ids, chunk=chunk)))
    return cache, seconds, box["logits"].argmax(-1)

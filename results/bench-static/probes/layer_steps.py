"""Shared by `decode_layer.py` and `pooled_step.py` (probes): ten cache layers at the bench's sizes (20 % of
4096 tokens, batch 4, SmolLM2's 3 KV heads x 3 query heads, head size 64), prefilled with random keys and
queries, repeated to batch 4 and decoded 3 steps; `step` runs them once with the same new token and
returns the time per layer in microseconds."""

import time

import torch

from h2o_kv import KVCache

B, H, G, D, N, LAYERS = 4, 3, 3, 64, 4096, 10


def build(policy, layer_class):
    torch.manual_seed(0)
    cache = KVCache(policy)
    layers = []
    for i in range(LAYERS):
        layer = layer_class(cache.settings, i)
        layer.update(torch.randn(1, H, N, D), torch.randn(1, H, N, D))
        layer.forward_attention(torch.randn(1, H * G, N, D), None, scaling=D**-0.5)
        layer.batch_repeat_interleave(B)
        for _ in range(3):
            layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
            layer.forward_attention(torch.randn(B, H * G, 1, D), None, scaling=D**-0.5)
        layers.append(layer)
    return layers


NEW = [(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H * G, 1, D)) for _ in range(LAYERS)]


def step(layers):
    begin = time.perf_counter()
    for layer, (k, v, q) in zip(layers, NEW):
        layer.update(k, v)
        layer.forward_attention(q, None, scaling=D**-0.5)
    return (time.perf_counter() - begin) / LAYERS * 1e6

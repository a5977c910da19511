"""One layer's decode step at the bench's sizes (20 % of 4096 tokens, batch 4, SmolLM2's 3 KV heads x 3
query heads, head size 64): SnapKV's uniform layer against AdaKV(SnapKV)'s head-pooled row, and the two
products each step makes, at their shapes (probe).

Ten layers of each are prefilled with random keys and queries and decoded (medians of 20 steps per round,
per layer). The products: the logits (queries x keys) and the weighted sum (probabilities x values), as
[B x H, 3, 820] x [B x H, 820, 64] batches for the uniform layer and [B, 9, 2466] x [B, 2466, 64] for
the pooled row (each query head spans every head's slots). What the pooled step costs beyond the uniform
one, less what its products cost beyond the uniform products, is its bookkeeping (tags, mask, topk).

    python results/bench-static/probes/pooled_step.py
"""

import statistics
import time

import torch
from layer_steps import LAYERS, B, D, G, H, build, step

from h2o_kv import AdaKV, SnapKV
from h2o_kv.layer import KVLayer
from h2o_kv.pooled import PooledKVLayer


def products(batches, rows, slots):
    q, keys = torch.randn(batches, rows, D), [torch.randn(batches, slots, D) for _ in range(LAYERS)]
    weights = torch.rand(batches, rows, slots)
    begin = time.perf_counter()
    for k in keys:
        torch.bmm(q, k.mT)  # the logits
        torch.bmm(weights, k)  # the weighted sum (the keys stand in for the values: same shape)
    return (time.perf_counter() - begin) / LAYERS * 1e6


with torch.inference_mode():
    uniform, pooled = build(SnapKV(budget=0.2), KVLayer), build(AdaKV(SnapKV(budget=0.2)), PooledKVLayer)
    slots = uniform[0].pos.shape[-1]
    for r in range(4):
        a = statistics.median(step(uniform) for _ in range(20))
        b = statistics.median(step(pooled) for _ in range(20))
        pa = statistics.median(products(B * H, G, slots) for _ in range(20))
        pb = statistics.median(products(B, H * G, pooled[0].pos.shape[-1]) for _ in range(20))
        print(f"round {r}: step uniform {a:.0f} us, pooled {b:.0f} us per layer; their products {pa:.0f} and {pb:.0f} us",
              flush=True)
print(f"slots per row: uniform {slots}, pooled {pooled[0].pos.shape[-1]} (torch threads {torch.get_num_threads()})")

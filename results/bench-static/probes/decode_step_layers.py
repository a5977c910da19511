"""The cache's share of a decode step: `native.decode_step` over 30 layers' storage, SmolLM2-135M's shapes at
batch 4 (3 KV heads of 64, 3 query heads each), 410 and 820 kept slots (H2O at 20 % of 2048 and 4096 tokens);
best of 8 passes, each layer's storage distinct (read from memory, as in the model). argv[1]: layers kept
distinct (1: one layer's storage 30 times, in the core's cache: the kernel's compute alone).
"""
import sys
import time

import torch

from h2o_kv import native

native.load()
B, H, G, D = 4, 3, 3, 64
distinct = int(sys.argv[1]) if len(sys.argv) > 1 else 30
print(f"# {torch.get_num_threads()} threads, {distinct} distinct layers")
for S in (410, 820):
    layers = []
    for _ in range(distinct):
        keys, values = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
        pos = torch.arange(S).expand(B, H, S).contiguous()
        layers.append((keys, values, pos, torch.rand(B, H, S), torch.rand(B, H, S)))
    q = torch.randn(B, H * G, 1, D)
    new_keys, new_values = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    slot = torch.zeros(B, H, 1, dtype=torch.long)
    qpos, recent, capacity = torch.full((B, 1), S + 5), torch.full((B, 1, 1), 8), torch.full((B, 1), S - 1)

    def step():
        for keys, values, pos, score, last in (layers * 30)[:30]:
            native.decode_step(q, keys, values, pos, score, last, slot, new_keys, new_values, qpos, recent, capacity,
                               scaling=0.125)  # fmt: skip

    step()
    best = 1e9
    for _ in range(8):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    kv = 30 * layers[0][0].numel() * 8
    print(f"S={S}: {best * 1e3:.2f} ms per 30 layers, KV {kv / 1e6:.0f} MB, {kv / best / 1e9:.1f} GB/s")

"""Interleaved decode steps at the bench's size: AdaKV against H2O and SnapKV at 20 % (probe).

4096-token prompts, batch 4, float32, 2 threads, rows-first model (as `h2o-kv bench --rows-first`). The
three caches are prefilled, then they decode in turn, 8 steps each, for 5 rounds, so the machine's drift
hits all alike. Prints each round's median step and the ratios of the medians over all rounds (the issue's
bar for a new policy: at most 1.1x H2O's step).
"""

import statistics
import time

import torch

from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.generation import decode_step, prefill
from h2o_kv.models import load_model

torch.set_num_threads(2)
model, _ = load_model("smollm2-135m", rows_first=True)
batch, n, steps, rounds = 4, 4096, 8, 5
prompt = torch.randint(100, 30000, (batch, n), generator=torch.Generator().manual_seed(0))
names = ("h2o", "snapkv", "adakv")
caches, tokens = {}, {}
with torch.inference_mode():
    for name in names:
        caches[name] = new_cache(model, name, policy_for(name, 0.2, n), max_len=n + steps * rounds + 1)
        tokens[name] = prefill(model, caches[name], prompt).argmax(-1)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            position = torch.full((batch,), n + r * steps)
            block = []
            for i in range(steps):
                begin = time.perf_counter()
                tokens[name] = decode_step(model, caches[name], tokens[name], position + i).argmax(-1)
                block.append(time.perf_counter() - begin)
            times[name] += block
            print(f"round {r} {name:7s} median step {statistics.median(block) * 1e3:6.1f} ms", flush=True)
median = {name: statistics.median(times[name]) * 1e3 for name in names}
print("all rounds: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in median.items()) + " per step")
print(f"AdaKV's step: {median['adakv'] / median['h2o']:.2f}x H2O's, {median['adakv'] / median['snapkv']:.2f}x SnapKV's")

"""Interleaved decode steps at the bench's bar size: StaticCache + SDPA against H2O at 20 % (probe).

4096-token prompts, batch 4, float32, 2 threads, rows-first model (as `h2o-kv bench --rows-first`). Both
caches are prefilled, then they decode in turn, 8 steps each, for 5 rounds, so the machine's drift (10-25 %
between runs here, even within a bench run of half an hour) hits both alike. Prints each round's median
step and the ratio of the medians over all rounds.
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
names = ("static-sdpa", "h2o")
caches, tokens = {}, {}
with torch.inference_mode():
    for name in names:
        caches[name] = new_cache(model, name, policy_for(name, 0.2, n), max_len=n + steps * rounds + 1)
        tokens[name] = prefill(model, caches[name], prompt).argmax(-1)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            model.set_attn_implementation("sdpa" if name == "static-sdpa" else "h2o_kv")  # each cache's path
            position = torch.full((batch,), n + r * steps)
            block = []
            for i in range(steps):
                begin = time.perf_counter()
                tokens[name] = decode_step(model, caches[name], tokens[name], position + i).argmax(-1)
                block.append(time.perf_counter() - begin)
            times[name] += block
            print(f"round {r} {name:12s} median step {statistics.median(block) * 1e3:6.1f} ms", flush=True)
static, h2o = (statistics.median(times[name]) * 1e3 for name in names)
print(f"all rounds: StaticCache {static:.1f} ms, H2O {h2o:.1f} ms per step: H2O decodes {static / h2o:.2f}x StaticCache")

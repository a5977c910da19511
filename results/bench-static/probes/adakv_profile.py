"""Where AdaKV's decode step goes against SnapKV's, in the model (probe).

The bench's size (4096-token prompts, batch 4, 20 %, float32, 2 threads, rows-first model): both caches are
prefilled, decode in turn (4 rounds of 6 steps, each round's median step printed), then 5 steps of each under
torch's profiler (the ops with the most time of their own, 5 steps x 30 layers; the profiler adds its own
overhead to every op). SnapKV is H2O's decode step with SnapKV's prompt scoring; AdaKV is SnapKV with the
layer's budget shared by its heads (one head-pooled row per layer, pooled.py).

    python results/bench-static/probes/adakv_profile.py
"""

import statistics
import time

import torch
from torch.profiler import profile

from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.generation import decode_step, prefill
from h2o_kv.models import load_model

torch.set_num_threads(2)
model, _ = load_model("smollm2-135m", rows_first=True)
batch, n = 4, 4096
prompt = torch.randint(100, 30000, (batch, n), generator=torch.Generator().manual_seed(0))
names = ("snapkv", "adakv")
caches, tokens, position = {}, {}, {}
with torch.inference_mode():
    for name in names:
        caches[name] = new_cache(model, name, policy_for(name, 0.2, n), max_len=n + 100)
        tokens[name] = prefill(model, caches[name], prompt).argmax(-1)
        position[name] = n

    def run(name, steps):
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            step = torch.full((batch,), position[name])
            tokens[name] = decode_step(model, caches[name], tokens[name], step).argmax(-1)
            position[name] += 1
            times.append(time.perf_counter() - begin)
        return statistics.median(times) * 1e3

    for r in range(4):
        print(f"round {r}: " + ", ".join(f"{name} {run(name, 6):.1f} ms" for name in names), flush=True)
    for name in names:
        with profile() as prof:
            run(name, 5)
        print(f"\n{name}, 5 steps under the profiler")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

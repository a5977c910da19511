"""Interleaved decode steps of three SmolLM2 models: stock `nn.Linear`, rows-first with torch's weight-first
product (`use_rows_first(compile_kernel=False)`), rows-first with h2o-kv's C++ kernel (`native.rows_linear`);
for StaticCache + SDPA and H2O at 20 % (probe).

Batch 4, a 4096-token prompt (the issue's shape), float32 or bfloat16 (argv[1]); the three models step in
turn, one step each, so the machine's drift hits all alike. Median of 14 steps after 2 warm-up steps.
"""

import statistics
import sys
import time

import torch

import h2o_kv.generation as g
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model
from h2o_kv.rows_first import use_rows_first

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
models = {name: load_model("smollm2-135m", dtype=dtype)[0] for name in ("stock", "rows-mm", "rows-kernel")}
use_rows_first(models["rows-mm"], compile_kernel=False)
use_rows_first(models["rows-kernel"], compile_kernel=True)
torch.manual_seed(0)
n = 4096
prompt = torch.randint(100, 30000, (4, n))
token = torch.randint(100, 30000, (4, 1))
print(f"# {dtype}, {torch.get_num_threads()} threads, batch 4, {n}-token prompt")
with torch.inference_mode():
    for cache_name in ("static-sdpa", "h2o"):
        caches = {}
        for name, model in models.items():
            caches[name] = new_cache(model, cache_name, policy_for(cache_name, 0.2, n), max_len=n + 40)
            g.forward(model, caches[name], prompt)
        times = {name: [] for name in models}
        for i in range(16):
            for name, model in models.items():
                start = time.perf_counter()
                g.forward(model, caches[name], token, positions=torch.full((4, 1), n + i))
                times[name].append(time.perf_counter() - start)
        stock = statistics.median(times["stock"][2:])
        for name, values in times.items():
            step = statistics.median(values[2:])
            print(f"{cache_name:12s} {name:12s} {1000 * step:6.1f} ms  ({stock / step:.2f}x stock)", flush=True)

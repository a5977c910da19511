"""Where H2O's prompt spends the time StaticCache's does not: one prompt (argv[1] tokens x argv[2] rows, default
4096 x 1) through SmolLM2-135M rows-first with freed memory kept (what the `h2o-kv` command does), StaticCache +
SDPA and H2O at 20 %, each after one untimed short prompt; the wall time of each prefill, then torch.profiler's
top operators of each (self CPU time).
"""

import sys
import time

import torch
from torch.profiler import profile

import h2o_kv.generation as g
from h2o_kv.allocator import retain_freed_memory
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
retain_freed_memory()
model = load_model("smollm2-135m", rows_first=True)[0]
prompt = torch.randint(100, 30000, (batch, n))
print(f"# {n} tokens x {batch}, {torch.get_num_threads()} threads")


def cache_for(name):
    return new_cache(model, name, policy_for(name, 0.2, n) if name == "h2o" else None, max_len=n + 8)


with torch.inference_mode():
    g.prefill(model, new_cache(model, "h2o", policy_for("h2o", 0.2, 64), max_len=72), prompt[:, :64])
    tables = []
    for name in ("static-sdpa", "h2o"):
        cache = cache_for(name)
        start = time.perf_counter()
        g.prefill(model, cache, prompt)
        print(f"{name:12s} prefill {time.perf_counter() - start:6.2f} s", flush=True)
        cache = cache_for(name)
        with profile() as prof:
            g.prefill(model, cache, prompt)
        tables.append((name, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)))
        del cache
for name, table in tables:
    print(f"\n## {name}\n{table}")

"""Interleaved decode steps, stock model against load_model(rows_first=True), for StaticCache + SDPA and H2O (probe).

Batch 4, a 2048-token prompt, H2O at 20 %; the two models step in turn, so the machine's drift hits both alike.
"""
import statistics
import time

import torch

import h2o_kv.generation as g
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

stock = load_model("smollm2-135m")[0]
rows = load_model("smollm2-135m", rows_first=True)[0]
torch.manual_seed(0)
n = 2048
prompt = torch.randint(100, 30000, (4, n))
t = torch.randint(100, 30000, (4, 1))
with torch.inference_mode():
    for name in ("static-sdpa", "h2o"):
        caches = {}
        for k, m in (("stock", stock), ("rows", rows)):
            caches[k] = new_cache(m, name, policy_for(name, 0.2, n), max_len=n + 40)
            g.forward(m, caches[k], prompt)
        ts = {"stock": [], "rows": []}
        for i in range(12):
            for k, m in (("stock", stock), ("rows", rows)):
                s = time.perf_counter()
                g.forward(m, caches[k], t, positions=torch.full((4, 1), n + i))
                ts[k].append(time.perf_counter() - s)
        for k, v in ts.items():
            print(name, k, f"{1000 * statistics.median(v[2:]):.1f} ms")

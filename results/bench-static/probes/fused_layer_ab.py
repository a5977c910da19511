"""Interleaved decode steps, rows-first model against rows-first + fused Llama layers (fused_layer.py), for
StaticCache + SDPA and H2O at 20 % (probe).

Batch 4, an N-token prompt (argv[1], default 2048), float32 (argv[2] to change), 2 threads; the two models step in
turn, so the machine's drift hits both alike. Also the bandwidth floor of H2O's step (the bench's own measure).
"""
import statistics
import sys
import time

import torch

import h2o_kv.generation as g
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv import rows_first
from h2o_kv.fused_layer import FusedLlamaDecoderLayer, use_fused_layers
from h2o_kv.models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
rows = load_model("smollm2-135m", dtype=dtype)[0]
rows_first.use_fused_layers = lambda model: 0  # this model: the linear swap alone, as before fused_layer.py
rows_first.use_rows_first(rows)
fused = load_model("smollm2-135m", dtype=dtype)[0]
rows_first.use_fused_layers = use_fused_layers
rows_first.use_rows_first(fused)
layers = sum(type(m) is FusedLlamaDecoderLayer for m in fused.modules())
assert not any(type(m) is FusedLlamaDecoderLayer for m in rows.modules())
print(f"# {n} tokens x 4, {dtype}, {torch.get_num_threads()} threads; fused layers: {layers}")
torch.manual_seed(0)
prompt = torch.randint(100, 30000, (4, n))
t = torch.randint(100, 30000, (4, 1))
with torch.inference_mode():
    for name in ("static-sdpa", "h2o"):
        caches = {}
        for k, m in (("rows-first", rows), ("fused", fused)):
            caches[k] = new_cache(m, name, policy_for(name, 0.2, n), max_len=n + 40)
            g.forward(m, caches[k], prompt)
        ts = {"rows-first": [], "fused": []}
        for i in range(16):
            for k, m in (("rows-first", rows), ("fused", fused)):
                s = time.perf_counter()
                g.forward(m, caches[k], t, positions=torch.full((4, 1), n + i))
                ts[k].append(time.perf_counter() - s)
        for k, v in ts.items():
            print(f"{name:12s} {k:10s} {1000 * statistics.median(v[2:]):6.1f} ms/step")

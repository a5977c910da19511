"""Where an H2O decode step's time goes with `load_model(rows_first=True)` (fused Llama layers): torch profiler
over 10 steps at batch 4, an N-token prompt (argv[1], default 4096), H2O at 20 %, float32, 2 threads (probe).
"""
import sys
import time

import torch

import h2o_kv.generation as g
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
model = load_model("smollm2-135m", rows_first=True)[0]
torch.manual_seed(0)
prompt, token = torch.randint(100, 30000, (4, n)), torch.randint(100, 30000, (4, 1))
with torch.inference_mode():
    cache = new_cache(model, "h2o", policy_for("h2o", 0.2, n), max_len=n + 40)
    g.forward(model, cache, prompt)
    for i in range(3):
        g.forward(model, cache, token, positions=torch.full((4, 1), n + i))
    start = time.perf_counter()
    for i in range(10):
        g.forward(model, cache, token, positions=torch.full((4, 1), n + 3 + i))
    print(f"# {n} tokens x 4, {torch.get_num_threads()} threads: {(time.perf_counter() - start) * 100:.1f} ms a step")
    with torch.profiler.profile() as prof:
        for i in range(10):
            g.forward(model, cache, token, positions=torch.full((4, 1), n + 13 + i))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

"""Page faults and time of one prompt (argv[1] tokens x argv[2] rows, default 4096 x 4) through SmolLM2-135M
rows-first, StaticCache + SDPA and H2O at 20 %, with glibc as it comes or told to keep freed memory
(argv[3] "retained": `h2o_kv.allocator.retain_freed_memory`, what the `h2o-kv` command does). Each
configuration's process prefills H2O, then StaticCache, after one untimed short prompt; the minor page faults
(first touches of new pages) are the process's own count (getrusage) around each prefill.
"""

import resource
import sys
import time

import torch

import h2o_kv.generation as g
from h2o_kv.allocator import retain_freed_memory
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
mode = retain_freed_memory() if len(sys.argv) > 3 and sys.argv[3] == "retained" else "system"
model = load_model("smollm2-135m", rows_first=True)[0]
prompt = torch.randint(100, 30000, (batch, n))
print(f"# {n} tokens x {batch}, malloc {mode}, {torch.get_num_threads()} threads")
with torch.inference_mode():
    g.prefill(model, new_cache(model, "h2o", policy_for("h2o", 0.2, 64), max_len=72), prompt[:, :64])
    for name in ("h2o", "static-sdpa"):
        cache = new_cache(model, name, policy_for(name, 0.2, n) if name == "h2o" else None, max_len=n + 8)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        g.prefill(model, cache, prompt)
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"{name:12s} prefill {seconds:6.1f} s, {faults:9,d} minor page faults", flush=True)
        del cache

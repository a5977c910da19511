"""Page faults of decode steps: SmolLM2-135M rows-first after an argv[1]-token prompt (default 2048) at batch 4,
H2O at 20 % and StaticCache + SDPA, 30 steps each after 3 untimed, with glibc as it comes or keeping freed
memory (argv[2] "retained", as the `h2o-kv` command runs): minor page faults per step and the median step.
"""

import resource
import statistics
import sys
import time

import torch

import h2o_kv.generation as g
from h2o_kv.allocator import retain_freed_memory
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

n, batch, steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2048, 4, 30
mode = retain_freed_memory() if len(sys.argv) > 2 and sys.argv[2] == "retained" else "system"
model = load_model("smollm2-135m", rows_first=True)[0]
prompt, token = torch.randint(100, 30000, (batch, n)), torch.randint(100, 30000, (batch, 1))
print(f"# {n} tokens x {batch}, malloc {mode}, {torch.get_num_threads()} threads")
with torch.inference_mode():
    for name in ("h2o", "static-sdpa"):
        cache = new_cache(model, name, policy_for(name, 0.2, n) if name == "h2o" else None, max_len=n + steps + 8)
        g.prefill(model, cache, prompt)
        position, seconds = n, []
        for _ in range(3):
            g.forward(model, cache, token, positions=torch.full((batch, 1), position))
            position += 1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(steps):
            start = time.perf_counter()
            g.forward(model, cache, token, positions=torch.full((batch, 1), position))
            seconds.append(time.perf_counter() - start)
            position += 1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"{name:12s} median step {1e3 * statistics.median(seconds):6.1f} ms, {faults / steps:.1f} faults a step")
        del cache

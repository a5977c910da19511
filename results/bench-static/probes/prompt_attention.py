"""One layer's prompt attention at SmolLM2-135M's shapes (batch 4, 9 query heads over 3 KV heads of 64, argv[1]
tokens, default 4096): torch's SDPA (causal, what StaticCache's prefill runs) against h2o-kv's `kernel.attend`
with H2O's scores (every query's probabilities summed per slot, what H2O's prefill runs), on torch's blocked path
and on h2o-kv's C++ prompt kernel (`native.prompt_attend`, what H2O's prefill runs where the kernels build); five
rounds of the three in turn after one untimed call each (best and median), then torch.profiler's table of one
blocked `kernel.attend` call.
"""

import statistics
import sys
import time

import torch
from torch.profiler import profile

from h2o_kv import kernel

torch.manual_seed(0)
B, Hq, H, D = 4, 9, 3, 64
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
q, k, v = torch.randn(B, Hq, n, D), torch.randn(B, H, n, D), torch.randn(B, H, n, D)
pos, qpos = torch.arange(n).expand(B, H, n).contiguous(), torch.arange(n).expand(B, n)


def sdpa():
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)


def h2o():
    return kernel.attend(q, k, v, pos, qpos, scaling=0.125, new_from=0, want_scores=True)


def h2o_native():
    return kernel.attend(q, k, v, pos, qpos, scaling=0.125, new_from=0, want_scores=True, native_kernels=True)


print(f"# {B} x {n} tokens, {Hq} query heads over {H} KV heads of {D}, {torch.get_num_threads()} threads")
runs = (("SDPA (causal)", sdpa), ("kernel.attend, H2O's scores", h2o), ("C++ prompt kernel, H2O's scores", h2o_native))
times = {name: [] for name, _ in runs}
for _name, f in runs:
    f()
for _ in range(5):  # in turn, so a machine that slows down for a while slows them alike
    for name, f in runs:
        start = time.perf_counter()
        f()
        times[name].append(time.perf_counter() - start)
for name, _ in runs:
    best, median = min(times[name]), statistics.median(times[name])
    print(f"{name:32s} {best * 1e3:6.0f} ms a layer (best of 5), median {median * 1e3:6.0f}", flush=True)
with profile() as prof:
    h2o()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))

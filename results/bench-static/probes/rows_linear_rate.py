"""How fast h2o-kv's product kernel multiplies when its weights are already in the core's caches (probe).

`native.rows_linear` at 4 rows (a decode step at batch 4) over a 192 x 576 weight (SmolLM2's k/v projection shape:
442 KB in float32, 221 KB in bfloat16, in the two cores' L2), 2000 calls, best of 5, on one thread and on torch's
default count: vector multiply-adds a second (4 rows x N x K / V lanes), against the machine's own rate
(`fma_rate.py`: 5.7-6.2 G per thread). With the weights in cache nothing waits for memory, so this is the
kernel's own rate, each call's overhead (Python, dispatch, the parallel region: a few us) included.
"""

import time

import torch

from h2o_kv import native

native.load()
V = 8 if "AVX2" in " ".join(native.flags()) else 16
rows, n, k, calls = 4, 192, 576, 2000
threads = torch.get_num_threads()
print(f"# {rows} rows, weight {n} x {k}, {calls} calls, best of 5, {V} float32 lanes")
for dtype in (torch.float32, torch.bfloat16):
    weight, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
    for count in (1, threads):
        torch.set_num_threads(count)
        for _ in range(50):
            native.rows_linear(x, weight, None)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                native.rows_linear(x, weight, None)
            best = min(best, (time.perf_counter() - start) / calls)
        rate = rows * n * k / V / best
        print(f"{str(dtype).removeprefix('torch.'):9s} {count} thread(s): {best * 1e6:6.1f} us a call, "
              f"{rate / 1e9:.2f} G vector multiply-adds/s ({rate / count / 1e9:.2f} a thread)")  # fmt: skip
torch.set_num_threads(threads)

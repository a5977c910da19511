"""How fast the products can read SmolLM2-135M's weights: 30 layers' q/k/v/o/gate/up/down matrices (float32,
425 MB) through `rows_linear` at 4 rows, one call per matrix; a torch sum per matrix; one sum over all of them
concatenated (the bench's bandwidth measure reads like this). 20 passes each, in turn; 2 threads by default."""
import time

import torch

from h2o_kv import native

native.load()
K, I = 576, 1536
shapes = [(576, K), (192, K), (192, K), (576, K), (I, K), (I, K), (K, I)]
layers = [[torch.randn(*s) for s in shapes] for _ in range(30)]
xs = {k: torch.randn(4, k) for k in (K, I)}


def products():
    for ws in layers:
        for w in ws:
            torch.ops.h2o_kv.rows_linear(xs[w.shape[1]], w, None)


def sums():
    for ws in layers:
        for w in ws:
            w.sum()


whole = torch.cat([w.flatten() for ws in layers for w in ws])
nbytes = whole.numel() * 4
times = {"rows_linear per matrix": [], "sum per matrix": [], "one sum": []}
for _ in range(20):
    for name, run in zip(times, (products, sums, whole.sum)):
        start = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - start)
print(f"# {torch.get_num_threads()} threads, {nbytes / 1e6:.0f} MB of weights, 20 passes each")
for name, ts in times.items():
    ts.sort()
    print(f"{name}: median {ts[10] * 1e3:.1f} ms ({nbytes / ts[10] / 1e9:.1f} GB/s), best {ts[0] * 1e3:.1f} ms")

"""Up to how many rows is the weight-first product faster for SmolLM2's decoder linears? (probe)

Every decoder linear layer's shape (q, k, v, o, gate, up, down of one layer: the 30 layers repeat them),
float32, 2 threads: F.linear(x, W) against (W @ x^T)^T at 4 to 128 rows, the two orders in turn for 7
rounds; prints each size's medians for one layer's seven products and the ratio. `rows_first.MAX_ROWS`
is the largest row count the library swaps the order for.
"""

import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
hidden, inter = 576, 1536
shapes = [(hidden, hidden), (192, hidden), (192, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
          (hidden, inter)]  # fmt: skip
layers = [[torch.randn(o, i) for o, i in shapes] for _ in range(30)]  # 30 layers' worth: weights come from memory


def step(rows: int, weight_first: bool) -> float:
    xs = {i: torch.randn(rows, i) for i in (hidden, inter)}
    begin = time.perf_counter()
    for weights in layers:
        for w in weights:
            x = xs[w.shape[1]]
            _ = torch.mm(w, x.t()).t().contiguous() if weight_first else F.linear(x, w)
    return (time.perf_counter() - begin) * 1e3


for rows in (4, 16, 20, 24, 32, 48, 64, 128):
    times = {False: [], True: []}
    for _ in range(7):
        for order in (False, True):
            times[order].append(step(rows, order))
    stock, first = statistics.median(times[False]), statistics.median(times[True])
    print(f"{rows:4d} rows: F.linear {stock:6.1f} ms, weight-first {first:6.1f} ms per 30 layers: {stock / first:.2f}x")

"""Where the weight-first products stop paying: every linear layer of SmolLM2-135M (float32, the output
projection included) times R rows, for R from 4 to 128, three ways in turn: `F.linear` (MKL's x @ W^T),
torch's weight-first product (W @ x^T)^T and h2o-kv's kernel (`native.rows_linear`). Medians of argv[1] passes
(default 7) after one warm-up, torch's default threads. `native.MAX_ROWS` is set from this table.
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from h2o_kv import native
from h2o_kv.models import load_model

passes = int(sys.argv[1]) if len(sys.argv) > 1 else 7
model = load_model("smollm2-135m")[0]
weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
ways = {
    "F.linear": F.linear,
    "(W @ x^T)^T": lambda x, w: (w @ x.T).T.contiguous(),
    "rows_linear": lambda x, w: native.rows_linear(x, w, None),
}
print(f"# SmolLM2-135M's {len(weights)} linear layers ({sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB float32), "
      f"{torch.get_num_threads()} threads, median of {passes} passes, ms per pass")
print(f"{'rows':>5s} " + " ".join(f"{name:>12s}" for name in ways) + "   F.linear / rows_linear")
with torch.inference_mode():
    for rows in (4, 8, 16, 20, 32, 48, 64, 96, 128):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        times = {name: [] for name in ways}
        for i in range(passes + 1):
            for name, way in ways.items():
                start = time.perf_counter()
                for w in weights:
                    way(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}
        print(f"{rows:5d} " + " ".join(f"{v:12.1f}" for v in ms.values()) + f"   {ms['F.linear'] / ms['rows_linear']:.2f}x",
              flush=True)

"""The decoder's products at 4 rows (a batch-4 decode step) on SmolLM2's own weights: torch's weight-first
product (rows_first.py without the kernel) against h2o-kv's C++ kernel (`native.rows_linear`) (probe).

Per group of weight matrices, the best of 5 passes over all 30 layers, in GB/s of weights read; the plain
sum of the same bytes is the memory's speed on this machine.
"""

import time

import torch

from h2o_kv import native
from h2o_kv.models import load_model

native.load()
model = load_model("smollm2-135m")[0]
layers = model.model.layers
groups = {
    "q/o 576x576": [m.self_attn.q_proj.weight for m in layers] + [m.self_attn.o_proj.weight for m in layers],
    "k/v 192x576": [m.self_attn.k_proj.weight for m in layers] + [m.self_attn.v_proj.weight for m in layers],
    "gate/up 1536x576": [m.mlp.gate_proj.weight for m in layers] + [m.mlp.up_proj.weight for m in layers],
    "down 576x1536": [m.mlp.down_proj.weight for m in layers],
    "head 49152x576": [model.lm_head.weight],
}
rows = {k: torch.randn(4, k) for k in (576, 1536)}
products = {
    "torch weight-first": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
    "F.linear (stock)": lambda x, w: torch.nn.functional.linear(x, w),
    "C++ kernel": lambda x, w: native.rows_linear(x, w, None),
}
total = dict.fromkeys(products, 0.0)
print(f"# {torch.get_num_threads()} threads, 4 rows, float32")
with torch.inference_mode():
    for group, weights in groups.items():
        best = {}
        for _ in range(5):
            for name, product in products.items():
                start = time.perf_counter()
                for w in weights:
                    product(rows[w.shape[1]], w)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - start)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        cells = [f"{name} {1e3 * t:5.2f} ms {nbytes / t / 1e9:4.1f} GB/s" for name, t in best.items()]
        print(f"{group:17s}", " | ".join(cells))
        for name, t in best.items():
            total[name] += t
    print("all products per step:", ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in total.items()))
    flat = torch.randn(sum(p.numel() for p in model.parameters()))
    start = time.perf_counter()
    for _ in range(5):
        flat.sum()
    print(f"plain sum of the weights' bytes: {flat.numel() * 4 * 5 / (time.perf_counter() - start) / 1e9:.1f} GB/s")

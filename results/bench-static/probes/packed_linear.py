"""Products of SmolLM2's decoder weights at batch 4 (one decode step's worth): F.linear, rows-first,
MKL's packed weights (torch.ops.mkl._mkl_linear), oneDNN (mkldnn linear_pointwise, to_mkldnn) (probe).

    python packed_linear.py [threads]
"""
import time, torch, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
B = 4
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
Ws = [torch.randn(o, i) for o, i in shapes]
xs = {i: torch.randn(B, i) for i in (576, 1536)}
def stock():
    for w in Ws: torch.nn.functional.linear(xs[w.shape[1]], w)
def rows_first():
    for w in Ws: torch.mm(w, xs[w.shape[1]].t()).t().contiguous()
variants = {"stock": stock, "rows_first": rows_first}
try:
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, B) for w in Ws]
    def mkl_packed():
        for w, p in zip(Ws, packed): torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, B)
    variants["mkl_packed"] = mkl_packed
except Exception as e: print("mkl packed:", repr(e)[:200])
try:
    dn = [torch.ops.mkldnn._reorder_linear_weight(w, B) if hasattr(torch.ops.mkldnn, "_reorder_linear_weight") else w for w in Ws]
    def onednn():
        for w, p in zip(Ws, dn): torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
    variants["onednn_linear_pointwise"] = onednn
except Exception as e: print("onednn:", repr(e)[:200])
try:
    from torch.utils import mkldnn as mu
    mods = [mu.to_mkldnn(torch.nn.Linear(w.shape[1], w.shape[0], bias=False)) for w in Ws]
    def onednn_mod():
        for w, m in zip(Ws, mods): m(xs[w.shape[1]])
    variants["mkldnn_module"] = onednn_mod
except Exception as e: print("mkldnn module:", repr(e)[:200])
ref = [torch.nn.functional.linear(xs[w.shape[1]], w) for w in Ws[:7]]
for name, f in variants.items():
    try:
        for _ in range(3): f()
        ts = []
        for _ in range(15):
            s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
        ms = sorted(ts)[7] * 1e3
        print(f"{name:26s} {ms:7.1f} ms per step of products, {sum(w.numel() for w in Ws)*4/ms/1e6:5.1f} GB/s")
    except Exception as e: print(name, "failed:", repr(e)[:300])

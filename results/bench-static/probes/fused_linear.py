"""Rows-first products of SmolLM2's decoder weights at batch 4: separate, fused per layer (qkv, gate+up),
and ten big blocks; against a plain sum's read bandwidth (probe).

    python fused_linear.py [threads]
"""
import time, torch, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
B = 4
def bench(Ws, label):
    xs = {i: torch.randn(B, i) for i in (576, 1536)}
    def f():
        for w in Ws: torch.mm(w, xs[w.shape[1]].t()).t().contiguous()
    for _ in range(3): f()
    ts = []
    for _ in range(15):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    ms = sorted(ts)[7] * 1e3
    print(f"{label:34s} {len(Ws):4d} calls {ms:7.1f} ms, {sum(w.numel() for w in Ws)*4/ms/1e6:5.1f} GB/s")
sep = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
fused = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
bench([torch.randn(*s) for s in sep], "separate (rows-first)")
bench([torch.randn(*s) for s in fused], "fused qkv + gate/up")
bench([torch.randn(4 * 960 + 2 * 576 + 3072 * 4, 576) for _ in range(10)], "big blocks [16512x576] x10")
a = torch.randn(135_000_000 // 4 * 4)
s = time.perf_counter(); [a.sum() for _ in range(5)]; print(f"plain sum {a.numel()*4*5/(time.perf_counter()-s)/1e9:.1f} GB/s")

"""Output projection timing: F.linear(x, W) against (W @ x^T)^T at several batch sizes (probe)."""
import torch, time
def t(f, n=20):
    for _ in range(3): f()
    s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e3
W = torch.randn(49152,576)
for b in [1,2,4,8,20,64]:
    x = torch.randn(b,576)
    a = t(lambda: torch.nn.functional.linear(x, W)); c = t(lambda: torch.mm(W, x.t()).t())
    d = t(lambda: torch.cat([torch.mv(W, r) for r in x]))
    print(b, f"linear {a:.1f}ms  W@xT {c:.1f}ms mv-loop {d:.1f}", torch.allclose(torch.nn.functional.linear(x, W), torch.mm(W, x.t()).t(), atol=1e-4))

"""bfloat16 against float32 products on this CPU (AVX2, no AVX-512 BF16): decode and prefill linears, attention (probe)."""
import time, torch, statistics
torch.manual_seed(0)
def t(f, n=5):
    f(); ts=[]
    for _ in range(n):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    return 1e3*statistics.median(ts)
for dt in (torch.float32, torch.bfloat16):
    W=torch.randn(1536,576,dtype=dt); x4=torch.randn(4,576,dtype=dt); xp=torch.randn(4096,576,dtype=dt)
    q=torch.randn(4,3,3*512,64,dtype=dt); k=torch.randn(4,3,4096,64,dtype=dt)
    qs=torch.randn(4,9,4096,64,dtype=dt); ks=torch.randn(4,3,4096,64,dtype=dt)
    print(dt, f"linear M=4 {t(lambda: torch.nn.functional.linear(x4,W)):.3f} ms",
          f"rows-first M=4 {t(lambda: (W@x4.t()).t().contiguous()):.3f} ms",
          f"linear M=4096 {t(lambda: torch.nn.functional.linear(xp,W)):.1f} ms",
          f"attn block q.kT {t(lambda: torch.matmul(q,k.mT)):.1f} ms",
          f"sdpa 4096 {t(lambda: torch.nn.functional.scaled_dot_product_attention(qs,ks,ks,is_causal=True,enable_gqa=True)):.0f} ms")

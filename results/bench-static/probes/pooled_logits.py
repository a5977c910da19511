"""A head-pooled (AdaKV) decode step's logits at 4096 x 4 and 20 % (3 KV heads x 821 slots per row, 9 query heads):
A: product, then the mask added in a second pass (before); B: product, scale and mask in place; C: the mask
expanded to [B, Hq, S] and added inside the product (baddbmm, now); D: scaled query, product, mask in place."""
import time, torch
B,H,G,S,D=4,3,3,2463,64
q=torch.randn(B,H*G,D); K=torch.randn(B,S,D); bias=torch.where(torch.rand(B,H,1,S)<0.33,0.0,float("-inf"))
def A():
    lg=torch.baddbmm(q.new_zeros(1,1,1).expand(B,H*G,S), q, K.mT, beta=0.0, alpha=0.125).view(B,H,G,S)
    return lg+bias
def Bv():
    lg=torch.bmm(q, K.mT).view(B,H,G,S)
    return lg.mul_(0.125).add_(bias)
def C():
    b9=bias.expand(B,H,G,S).reshape(B,H*G,S)
    return torch.baddbmm(b9, q, K.mT, alpha=0.125).view(B,H,G,S)
def Dv():
    return torch.bmm(q*0.125, K.mT).view(B,H,G,S).add_(bias)
print([ (A()-f()).abs().nan_to_num().max().item() for f in (Bv,C,Dv)])
def t(f,n=300):
    for _ in range(20): f()
    ts=[]
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter()-t0)/n*1e6)
    return sorted(ts)[2]
for th in (1,2):
    torch.set_num_threads(th)
    print(th, "threads: A %.0f  B %.0f  C %.0f  D %.0f us"%(t(A),t(Bv),t(C),t(Dv)))

"""attend_one's int8 path against alternatives at the bench's decode shapes (B 4, 3 KV heads x 3, 821 slots)."""
import time, torch, sys
from h2o_kv.kernel import attend_one
torch.set_num_threads(2)
B,H,G,S,D=4,3,3,821,64
q=torch.randn(B,H*G,1,D); k=torch.randn(B,H,S,D); v=torch.randn(B,H,S,D)
pos=torch.arange(S).expand(B,H,S).clone(); pos[...,5]=-1
k8=torch.randint(-127,127,(B,H,S,D),dtype=torch.int8); v8=torch.randint(-127,127,(B,H,S,D),dtype=torch.int8)
ks=torch.rand(B,H,S)/100; vs=torch.rand(B,H,S)/100
def alt(q,keys,values,pos,key_scale,value_scale,scaling):
    bias=torch.where(pos<0,float('-inf'),0.0)
    kf=torch.mul(keys,key_scale[...,None])      # int8 x float32 -> float32 in one pass
    logits=torch.baddbmm(bias.view(-1,1,S).expand(B*H,G,S),q.reshape(B*H,G,D),kf.view(B*H,S,D).mT,alpha=scaling).view(B,H,G,S)
    probs=torch.softmax(logits,-1)
    out=torch.matmul(probs*value_scale[:,:,None],values.to(q.dtype))
    return out.view(B,1,H*G,D),probs.sum(2),None
def t(f,*a,n=300,**kw):
    for _ in range(10): f(*a,**kw)
    s=time.perf_counter()
    for _ in range(n): f(*a,**kw)
    return (time.perf_counter()-s)/n*1e6
ref=attend_one(q,k8,v8,pos,scaling=0.125,want_scores=True,key_scale=ks,value_scale=vs)
o=alt(q,k8,v8,pos,ks,vs,0.125)
print("max err", (o[0]-ref[0]).abs().max().item(), (o[1]-ref[1]).abs().max().item())
for r in range(2):
    print("f32 attend_one   %.0f us"%t(attend_one,q,k,v,pos,scaling=0.125,want_scores=True))
    print("int8 attend_one  %.0f us"%t(attend_one,q,k8,v8,pos,scaling=0.125,want_scores=True,key_scale=ks,value_scale=vs))
    print("int8 fused-scale %.0f us"%t(alt,q,k8,v8,pos,ks,vs,0.125))
    print("k8.to(float)     %.0f us"%t(lambda: k8.to(torch.float32)))
    print("k8*scale         %.0f us"%t(lambda: torch.mul(k8,ks[...,None])))

"""Interleaved decode steps of float32 and int8 H2O (820 kept of 1024, batch 4, rows-first, 2 threads): 8 steps
of each in turn, four rounds, so drift hits both alike (probe)."""
import time, torch, sys, gc
from h2o_kv.models import load_model
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.bench.timing import prefill, decode_steps
torch.set_num_threads(2)
model,tok=load_model("smollm2-135m", rows_first=True)
B,P=4,1024
ids=torch.randint(0,1000,(B,P))
caches={}
with torch.inference_mode():
    for name in ("h2o","h2o-int8"):
        caches[name]=new_cache(model, name, policy_for(name, 820, P), max_len=P+80)
        caches[name+"_tok"],_=prefill(model,caches[name],ids)
    pos={n:P for n in ("h2o","h2o-int8")}
    for r in range(4):
        for name in ("h2o","h2o-int8"):
            ts=decode_steps(model,caches[name],caches[name+"_tok"],pos[name],8); pos[name]+=8
            print(r,name,"median step ms %.1f"%(sorted(ts)[4]*1e3), "min %.1f"%(min(ts)*1e3), flush=True)

"""Gemma/SmolLM NIAH at one budget for SnapKV variants (probe; not a committed result).
usage: gvar.py MODEL CTX N BUDGET variant[,variant...]  variant: snapkv | global:SHARE | pyramid:BETA | snap:POOL:WINDOW"""
import sys, time, torch
import h2o_kv
import h2o_kv.eval.decoding as dec
from h2o_kv.policies import SnapKV, LayerBudgets
from h2o_kv.data import load_corpus
from h2o_kv.eval.retrieval import make_samples, run_retrieval
torch.set_num_threads(1)
model_name, ctx, n, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
model, tok = h2o_kv.load_model(model_name)
hay = load_corpus(None, max_chars=2_000_000)
samples = make_samples(tok, hay, tasks=("niah_single",), context_tokens=ctx, n=n, seed=0)
def make(spec, b):
    kind, *args = spec.split(":")
    if kind == "global": return LayerBudgets(SnapKV(budget=b), "global", sliding_share=float(args[0]))
    if kind == "pyramid": return LayerBudgets(SnapKV(budget=b), "pyramid", beta=float(args[0]))
    if kind == "snap": return SnapKV(budget=b, pool=int(args[0]), window=int(args[1]))
    return SnapKV(budget=b)
for spec in sys.argv[5].split(","):
    dec.build = lambda name, b, spec=spec: make(spec, b)
    t = time.time()
    rows = run_retrieval(model, tok, samples, [("x", budget)], prefill="oneshot", gen_cap=16)
    print(model_name, ctx, budget, spec, [(r["score"], r["n"]) for r in rows], f"{time.time()-t:.0f}s", flush=True)

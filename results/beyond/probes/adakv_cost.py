"""What Ada-KV's head-wise allocation would cost in h2o-kv's [batch, KV heads, slots] storage.
Per layer: SnapKV scores (window 32, pool 31) of a NIAH prompt; Ada-KV keeps the top H x cap tokens
over the layer's heads; storage must hold the largest head's share for every head."""
import sys, torch
import h2o_kv
from h2o_kv.policies import SnapKV
from h2o_kv.data import load_corpus
from h2o_kv.eval.retrieval import make_samples
from h2o_kv.generation import encode, prefill
torch.set_num_threads(1)
model_name, ctx = sys.argv[1], int(sys.argv[2])
model, tok = h2o_kv.load_model(model_name)
samples = make_samples(tok, load_corpus(None, max_chars=2_000_000), tasks=("niah_single",), context_tokens=ctx, n=5, seed=0)
for frac in (0.1, 0.2):
    over = []
    for s in samples:
        ids = encode(tok, s.prompt)
        cache = h2o_kv.KVCache(SnapKV(budget=len(ids)))
        with torch.inference_mode():
            prefill(model, cache, torch.tensor([ids]))
        cap = int(frac * len(ids))
        for layer in cache.layers:
            score = layer.score[0]  # [H, S]
            heads = score.shape[0]
            if heads == 1: continue
            top = score.flatten().topk(heads * cap).indices // score.shape[1]
            counts = torch.bincount(top, minlength=heads)
            over.append(float(counts.max()) / cap)
    import statistics
    print(model_name, ctx, frac, f"largest head / uniform budget: mean {statistics.mean(over):.2f}, max {max(over):.2f} over {len(over)} layer-prompts")

"""Streaming perplexity (token by token) of H2O with score decay and other recent-window shares.

`perplexity_foresight.py` shows what eviction needs: the attention a token will get from *later* queries
(all of them). H2O's accumulated score ranks by the attention of all *earlier* queries, which favours old
tokens; a decayed score (`H2O(decay=d)`: older attention counts d^n less) ranks by the recent rate of
attention, which is the better predictor of what comes (`results/beyond/probes/perplexity_foresight.txt`).
Variants are tuned on windows of another seed (`SEED`, the windows after the first tenth of each play
start at other offsets) and only then run on the evaluation's windows (seed 0).

    python results/beyond/probes/perplexity_decay.py SEED N L BUDGET name[,name...]
    (name: h2o, or d<decay>_r<recent share>, e.g. d0.995_r0.5; n<recent share> for normalize=True)
"""

import math
import sys
import time

import torch

import h2o_kv
from h2o_kv import H2O, KVCache
from h2o_kv.eval.perplexity import perplexity_stats, stream_nll, text_windows

torch.set_num_threads(1)
seed, n, length, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
model, tok = h2o_kv.load_model("smollm2-135m")
windows = text_windows(tok, None, n=n, length=length, seed=seed)
cap = int(budget * length)


def policy(name: str) -> H2O:
    if name == "h2o":
        return H2O(budget=cap)
    if name.startswith("n"):
        return H2O(budget=cap, recent=round(cap * float(name[1:])), normalize=True)
    decay, share = name[1:].split("_r")
    return H2O(budget=cap, recent=round(cap * float(share)), decay=float(decay))


with torch.no_grad():
    full_ppl = perplexity_stats(stream_nll(model, windows, "full", None))["ppl"]
    print(f"seed {seed}, {n} x {length}: full ppl {full_ppl:.3f}", flush=True)
    for name in sys.argv[5].split(","):
        begin, nll = time.time(), []
        for window in windows:
            ids = window.view(1, -1)
            logits = model(ids, past_key_values=KVCache(policy(name), prefill_chunk=1), use_cache=True).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none"))
        ppl = math.exp(torch.cat(nll).double().mean())
        print(
            f"{name:16s} budget {budget:g}  ppl {ppl:.3f}  {100 * (ppl / full_ppl - 1):+.1f} %"
            f"  {time.time() - begin:.0f}s",
            flush=True,
        )

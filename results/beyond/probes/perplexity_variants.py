"""Streaming perplexity (token by token) of H2O variants on n windows of L tokens at one budget (probe).
usage: perplexity_variants.py N L BUDGET variant[,variant...]"""
import sys, time, math, torch
import h2o_kv
from h2o_kv import H2O, KVCache
from h2o_kv.policies import Sinks, SnapKV, Full, build
from h2o_kv.eval.perplexity import text_windows
from h2o_kv.generation import forward
torch.set_num_threads(1)
n = int(sys.argv[1]); L = int(sys.argv[2]); b = float(sys.argv[3])
model, tok = h2o_kv.load_model("smollm2-135m")
win = text_windows(tok, None, n=n, length=L, seed=0)
cap = int(b * L)
variants = {
  "full": Full(),
  "h2o": H2O(budget=cap),
  "h2o_decay0.99": H2O(budget=cap, decay=0.99),
  "h2o_decay0.995": H2O(budget=cap, decay=0.995),
  "h2o_norm": H2O(budget=cap, normalize=True),
  "sinks_h2o": Sinks(H2O(budget=cap)),
  "sinks_h2o_decay0.99": Sinks(H2O(budget=cap, decay=0.99)),
  "snapkv": SnapKV(budget=cap),
  "h2o_pyr20": h2o_kv.LayerBudgets(H2O(budget=cap), "pyramid", beta=20),
  "h2o_pyr2": h2o_kv.LayerBudgets(H2O(budget=cap), "pyramid", beta=2),
  "h2o_pyr1.3": h2o_kv.LayerBudgets(H2O(budget=cap), "pyramid", beta=1.3),
  "adakv_h2o": h2o_kv.AdaKV(H2O(budget=cap)),
  "adakv_snapkv": h2o_kv.AdaKV(SnapKV(budget=cap)),
  # the budget's split: H2O keeps half of it for the recent window; these keep a share r of it
  **{f"h2o_recent{r}": H2O(budget=cap, recent=max(1, int(cap * r))) for r in (0.1, 0.25, 0.75, 0.9)},
}
sel = sys.argv[4].split(",") if len(sys.argv) > 4 else list(variants)
for name in sel:
    pol = variants[name]; t = time.time(); nll = []
    with torch.no_grad():
        for w in win:
            ids = w.view(1, -1)
            logits = model(ids, past_key_values=KVCache(pol, prefill_chunk=1), use_cache=True).logits[0, :-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
    nll = torch.cat(nll)
    print(f"{name:22s} ppl {math.exp(nll.mean()):.3f}  {time.time()-t:.0f}s", flush=True)

"""Streaming perplexity (token by token) of H2O plus one summary slot per (sequence, KV head) that stands for
every token it evicted: key and value the mean of the evicted ones, and with `lse` its logit raised by
log(count), so it gets the mean evicted logit + log n (Jensen's lower bound of their log-sum-exp). An idea
beyond the published ones (merging per evicted token, D2O / CaM, is perplexity_merge.py). Probe: the
layer's eviction and decode attention are wrapped in this process only; `off` is plain H2O.

    python results/beyond/probes/perplexity_summary_slot.py N L BUDGET off|lse|mean
"""
import sys, time, math, torch
import h2o_kv
from h2o_kv import H2O, KVCache
import h2o_kv.layer as L
from h2o_kv.eval.perplexity import text_windows
torch.set_num_threads(1)
n = int(sys.argv[1]); Ln = int(sys.argv[2]); b = float(sys.argv[3]); MODE = sys.argv[4]
orig_evict, orig_attend = L.KVLayer._evict, L.KVLayer._attend
def _evict(self, next_pos, window, added):
    before = self.pos.clone()
    orig_evict(self, next_pos, window, added)
    freed = (before >= 0) & (self.pos < 0)
    if not hasattr(self, "sk"):
        B, H, S, D = self.keys.shape
        self.sk = self.keys.new_zeros(B, H, D); self.sv = self.values.new_zeros(B, H, D); self.cnt = self.keys.new_zeros(B, H)
    if bool(freed.any()):
        f = freed[..., None].to(self.keys.dtype)
        self.sk += (self.keys * f).sum(2); self.sv += (self.values * f).sum(2); self.cnt += freed.sum(-1)
def _attend(self, query, positions, **o):
    if MODE == "off" or query.shape[2] != 1 or not hasattr(self, "sk") or not bool((self.cnt > 0).any()):
        return orig_attend(self, query, positions, **o)
    B, Hq, _, D = query.shape; H = self.keys.shape[1]; G = Hq // H; s = o["scaling"]
    q = query.view(B, H, G, D)
    lg = torch.matmul(q, self.keys.mT) * s
    lg = lg.masked_fill((self.pos < 0)[:, :, None], float("-inf"))
    cnt = self.cnt.clamp(min=1)[..., None]
    km, vm = self.sk / cnt, self.sv / cnt
    sl = (q * km[:, :, None]).sum(-1, keepdim=True) * s  # [B,H,G,1]
    if MODE == "lse": sl = sl + torch.log(cnt)[:, :, None]
    sl = sl.masked_fill((self.cnt == 0)[:, :, None, None], float("-inf"))
    p = torch.softmax(torch.cat([lg, sl], -1), -1)
    out = torch.matmul(p[..., :-1], self.values) + p[..., -1:] * vm[:, :, None]
    scores = p[..., :-1].sum(2) if o.get("want_scores") else None
    return out.reshape(B, 1, Hq, D), scores, None
L.KVLayer._evict, L.KVLayer._attend = _evict, _attend
model, tok = h2o_kv.load_model("smollm2-135m")
win = text_windows(tok, None, n=n, length=Ln, seed=0)
pol = H2O(budget=int(b * Ln)); t = time.time(); nll = []
with torch.no_grad():
    for w in win:
        ids = w.view(1, -1)
        logits = model(ids, past_key_values=KVCache(pol, prefill_chunk=1), use_cache=True).logits[0, :-1].float()
        nll.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
nll = torch.cat(nll)
print(f"h2o summary={MODE:5s} budget {b} ppl {math.exp(nll.mean()):.3f}  {time.time()-t:.0f}s", flush=True)

"""Probe: H2O that merges each evicted token into its most similar kept token (D2O / CaM style), streaming perplexity.

usage: perplexity_merge.py N L BUDGET variant[,variant...] [THRESHOLD]; variants: h2o, merge_v (the evicted value is
mixed into the kept slot whose key is most cosine-similar, weighted by accumulated attention), merge_kv (keys too).
It replaces KVLayer._evict in its own process only; the library does not merge."""
import sys, time, math, torch
import h2o_kv
from h2o_kv import H2O, KVCache
from h2o_kv.layer import KVLayer
from h2o_kv.eval.perplexity import text_windows
torch.set_num_threads(1)
n = int(sys.argv[1]); L = int(sys.argv[2]); b = float(sys.argv[3])
MODE = {"v": None}
orig = KVLayer._evict
def _evict(self, next_pos, window, added):
    mode = MODE["v"]
    if mode is None or added != 1 or self.capacity is None or self.kept_bound <= self.min_capacity:
        return orig(self, next_pos, window, added)
    pos_before = self.pos.clone()
    score_before = self.score.clone()
    orig(self, next_pos, window, added)
    freed = (pos_before >= 0) & (self.pos < 0)  # [B,H,S] at most one per head
    if not bool(freed.any()):
        return
    victim = freed.float().argmax(-1, keepdim=True)  # [B,H,1]
    has = freed.any(-1, keepdim=True)
    D = self.keys.shape[-1]
    kv = self.keys.gather(2, victim[..., None].expand(-1, -1, -1, D))  # [B,H,1,D]
    vv = self.values.gather(2, victim[..., None].expand(-1, -1, -1, D))
    sv = score_before.gather(2, victim)  # [B,H,1]
    keys = self.keys
    sim = torch.nn.functional.cosine_similarity(keys, kv, dim=-1)  # [B,H,S]
    sim = sim.masked_fill(self.pos < 0, -2)
    if mode == "recent_excl":  # do not merge into the recent window's newest token
        pass
    best, target = sim.max(-1, keepdim=True)
    ok = has & (best > THRESH)
    st = self.score.gather(2, target)
    w = (sv / (st + sv).clamp_min(1e-9))
    w = torch.where(ok, w, torch.zeros_like(w))[..., None]  # [B,H,1,1]
    idx = target[..., None].expand(-1, -1, -1, D)
    vt = self.values.gather(2, idx); kt = self.keys.gather(2, idx)
    self.values.scatter_(2, idx, vt + w * (vv - vt))
    if mode == "kv":
        self.keys.scatter_(2, idx, kt + w * (kv - kt))
    self.score.scatter_add_(2, target, torch.where(ok, sv, torch.zeros_like(sv)))
KVLayer._evict = _evict
model, tok = h2o_kv.load_model("smollm2-135m")
win = text_windows(tok, None, n=n, length=L, seed=0)
cap = int(b * L)
THRESH = float(sys.argv[5]) if len(sys.argv) > 5 else -1.0
for name in sys.argv[4].split(","):
    MODE["v"] = {"h2o": None, "merge_v": "v", "merge_kv": "kv"}[name.split("@")[0]]
    pol = H2O(budget=cap); t = time.time(); nll = []
    with torch.no_grad():
        for w in win:
            ids = w.view(1, -1)
            logits = model(ids, past_key_values=KVCache(pol, prefill_chunk=1), use_cache=True).logits[0, :-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
    nll = torch.cat(nll)
    print(f"{name:22s} thresh {THRESH} ppl {math.exp(nll.mean()):.3f}  {time.time()-t:.0f}s", flush=True)

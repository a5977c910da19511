"""How close can any eviction policy get to Full's streaming perplexity at a given token budget?

An oracle that sees each query before choosing: every query of every layer attends only to the `cap + 1`
earlier tokens (the most a KVCache of capacity `cap` attends to: its kept tokens and the new one) that it
puts the most attention probability on, the softmax renormalised over them (as eviction does). Per KV head
(`group`): the query heads that share a KV head share the set, ranked by their summed probabilities (the
set a per-(sequence, KV head) cache could hold); per query head (`qhead`): each its own set. No eviction
policy can choose better sets than this from what it has seen: it must fix its set before the query comes,
and once a token is evicted it cannot come back, where the oracle picks a fresh set for every query. So
the oracle's perplexity is (to the extent top-k by attention is the best set of k) a floor for every
policy's at the same number of tokens. One forward per window with the full context, no cache: the mask
does the selection.

    python results/beyond/probes/perplexity_oracle.py MODEL N L BUDGET[,BUDGET...] variant[,variant...]
"""

import math
import sys
import time

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import h2o_kv
from h2o_kv.eval.perplexity import text_windows

torch.set_num_threads(1)
model_name, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
budgets, variants = [float(b) for b in sys.argv[4].split(",")], sys.argv[5].split(",")
SETTINGS = {"keep": None, "per": "group"}


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of each query over the `keep` causal keys it (or its KV head's query heads) weighs most."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    keys = key.repeat_interleave(group, dim=1)
    logits = (query.float() @ keys.float().transpose(-1, -2)) * scaling
    if kwargs.get("softcap"):
        logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
    pos_q = torch.arange(k_len - q_len, k_len).view(-1, 1)
    pos_k = torch.arange(k_len).view(1, -1)
    allowed = pos_k <= pos_q
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window:
        allowed = allowed & (pos_q - pos_k < window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    keep = SETTINGS["keep"]
    if keep is not None and keep < k_len:
        probs = logits.softmax(-1)
        if SETTINGS["per"] == "group":
            rank = probs.view(batch, kv_heads, group, q_len, k_len).sum(2).repeat_interleave(group, dim=1)
        else:
            rank = probs
        chosen = rank.topk(keep, dim=-1).indices
        mask = torch.zeros_like(allowed.expand_as(logits)).scatter(-1, chosen, True) & allowed
        logits = logits.masked_fill(~mask, float("-inf"))
    out = logits.softmax(-1).to(value.dtype) @ value.repeat_interleave(group, dim=1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("oracle_topk", oracle_attention)
AttentionMaskInterface.register("oracle_topk", sdpa_mask)

model, tok = h2o_kv.load_model(model_name)
model.set_attn_implementation("oracle_topk")
windows = text_windows(tok, None, n=n, length=length, seed=0)


def perplexity() -> float:
    nll = []
    with torch.no_grad():
        for window in windows:
            ids = window.view(1, -1)
            logits = model(ids, use_cache=False).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none"))
    return math.exp(torch.cat(nll).double().mean())


begin = time.time()
full = perplexity()
print(f"{model_name} {n} x {length}: full (this attention, nothing masked) ppl {full:.3f}  {time.time() - begin:.0f}s")
for budget in budgets:
    cap = int(budget * length)
    for per in variants:
        SETTINGS.update(keep=cap + 1, per=per)
        begin = time.time()
        ppl = perplexity()
        print(
            f"oracle per {per:6s} budget {budget:g} ({cap} + 1 tokens)  ppl {ppl:.3f}  {100 * (ppl / full - 1):+.1f} %"
            f"  {time.time() - begin:.0f}s",
            flush=True,
        )

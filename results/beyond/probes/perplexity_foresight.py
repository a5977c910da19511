"""Streaming perplexity of an eviction policy that knows the future: how good can eviction get at a budget?

`perplexity_oracle.py` lets every query pick its own best set, which eviction cannot: a cache fixes its kept
set before the next query arrives, and an evicted token never comes back. This probe keeps those rules
(the real `KVCache`, token by token, H2O's capacity) and gives the policy the future instead of the past:
a token's priority is the attention (summed over the KV head's query heads) that the *full-cache* model's
later queries pay it, all of them (`all`) or the next W (`next-W`), recorded from one full forward of the
window first. A Belady-style oracle for attention: no causal policy can know this, so where it misses the
bar, every eviction policy at that token count misses it too (to the extent the full model's future
attention is the right thing to keep, which is what every score-based policy assumes).

    python results/beyond/probes/perplexity_foresight.py MODEL N L BUDGET[,BUDGET...] variant[,variant...]
    (variants: all, next-W, h2o)
"""

import math
import sys
import time
from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import h2o_kv
from h2o_kv import H2O, KVCache
from h2o_kv.eval.perplexity import perplexity_stats, stream_nll, text_windows
from h2o_kv.policies.base import Policy

torch.set_num_threads(1)
model_name, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
budgets, variants = [float(b) for b in sys.argv[4].split(",")], sys.argv[5].split(",")
RECORDED: dict[int, torch.Tensor] = {}  # layer -> [KV heads, queries, keys] summed probabilities
FUTURE: dict[int, torch.Tensor] = {}  # layer -> [KV heads, next_pos, keys] attention still to come


def recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA's output; the group-summed probabilities of the (batch-1) call are recorded on the side."""
    q_heads, q_len, dim = query.shape[1:]
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    logits = (query[0].float() @ key[0].float().repeat_interleave(group, 0).transpose(-1, -2)) * (scaling or dim**-0.5)
    if kwargs.get("softcap"):
        logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
    pos_q, pos_k = torch.arange(k_len - q_len, k_len).view(-1, 1), torch.arange(k_len).view(1, -1)
    allowed = pos_k <= pos_q
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window:
        allowed = allowed & (pos_q - pos_k < window)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    RECORDED[module.layer_idx] = probs.view(kv_heads, group, q_len, k_len).sum(1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register("recording", recording_attention)
AttentionMaskInterface.register("recording", sdpa_mask)


@dataclass(frozen=True)
class Foresight(Policy):
    """Keep the `budget` tokens the full model's later queries will attend to most."""

    budget: int = 1
    layer: int = -1

    def capacity(self, prompt_len):
        return torch.full_like(prompt_len, self.budget)

    def for_layer(self, layer_idx, config):
        return replace(self, layer=layer_idx)

    def priority(self, state):
        future = FUTURE[self.layer]  # [H, L + 1, L]
        t = int(state.next_pos.view(-1)[0])
        return future[:, min(t, future.shape[1] - 1)].gather(-1, state.pos[0].clamp(min=0)).unsqueeze(0)


def record(ids, lookahead):
    """FUTURE[layer][h, t, k]: attention key k gets from queries t .. t + lookahead - 1 of the full model."""
    model.set_attn_implementation("recording")
    with torch.no_grad():
        model(ids, use_cache=False)
    h2o_kv.enable(model)
    for layer, probs in RECORDED.items():
        kv_heads, q_len, k_len = probs.shape
        rest = torch.cat([probs.flip(1).cumsum(1).flip(1), probs.new_zeros(kv_heads, 1, k_len)], 1)  # sum q >= t
        if lookahead is not None:
            rest = rest - torch.cat([rest[:, lookahead:], rest.new_zeros(kv_heads, lookahead, k_len)], 1)
        FUTURE[layer] = rest
    RECORDED.clear()


model, tok = h2o_kv.load_model(model_name)
windows = text_windows(tok, None, n=n, length=length, seed=0)
full = perplexity_stats(stream_nll(model, windows, "full", None))["ppl"]
print(f"{model_name} {n} x {length}: full ppl {full:.3f}")
for budget in budgets:
    cap = int(budget * length)
    for variant in variants:
        begin, nll = time.time(), []
        for window in windows:
            ids = window.view(1, -1)
            if variant == "h2o":
                policy = H2O(budget=cap)
            else:
                record(ids, None if variant == "all" else int(variant.split("-")[1]))
                policy = Foresight(budget=cap)
            with torch.no_grad():
                cache = KVCache(policy, prefill_chunk=1, compile_kernel=False)
                logits = model(ids, past_key_values=cache, use_cache=True).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none"))
        ppl = math.exp(torch.cat(nll).double().mean())
        print(
            f"{variant:10s} budget {budget:g} ({cap} tokens)  ppl {ppl:.3f}  {100 * (ppl / full - 1):+.1f} %"
            f"  {time.time() - begin:.0f}s",
            flush=True,
        )

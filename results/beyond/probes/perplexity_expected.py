"""Streaming perplexity (token by token) of ranking kept tokens by the attention *future* queries are expected
to pay them (Expected Attention: Devoto et al. 2025, arXiv 2510.00636, kvpress's ExpectedAttentionPress), the
causal stand-in for `perplexity_foresight.py`'s oracle. Probe: the layer's queries and keys are handed to the
policy in this process only.

Each layer keeps the running mean of its queries with RoPE undone (per KV head, over the head's query heads
and every query so far: `mean`, or a decayed mean: `ema0.99`); a future query at position t + j is expected
to be that mean rotated to t + j, averaged over j = 1 .. HORIZON; a kept key's priority is its logit against
it (`ea`), plus half the keys' squared components weighted by the queries' variance (`eav`: the Gaussian's
E[exp(q.k)]), the `recent` newest kept as in H2O.

    python results/beyond/probes/perplexity_expected.py SEED N L BUDGET name[,name...]
    (name: h2o, or ea|eav _ mean|ema<d> _h<horizon> _r<recent share>, e.g. ea_mean_h512_r0.5)
"""

import math
import sys
import time
from dataclasses import dataclass

import torch

import h2o_kv
import h2o_kv.layer as layer_mod
from h2o_kv import H2O, KVCache
from h2o_kv.eval.perplexity import perplexity_stats, stream_nll, text_windows
from h2o_kv.policies.base import Policy, tokens_of

torch.set_num_threads(1)
seed, n, length, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
model, tok = h2o_kv.load_model("smollm2-135m")
config = model.config
DIM, GROUP = config.head_dim, config.num_attention_heads // config.num_key_value_heads
INV_FREQ = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, DIM, 2).float() / DIM))
STATS: dict[int, dict] = {}  # layer -> running moments of the unrotated queries [B, H, D]
HANDED = {}
SETUP = {"decay": None}
attend, slot_state = layer_mod.KVLayer._attend, layer_mod.KVLayer.slot_state


def rotate_half(x):
    return torch.cat((-x[..., DIM // 2 :], x[..., : DIM // 2]), -1)


def angles(pos):  # [...] positions -> cos, sin [..., D]
    freqs = pos.float()[..., None] * INV_FREQ
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def watching_attend(self, query, positions, full=False, **options):
    """Update the layer's query moments with this chunk's queries (RoPE undone) before it evicts."""
    batch, q_heads, count, _ = query.shape
    cos, sin = angles(positions.clamp(min=0))  # [B, n, D]
    plain = query.float() * cos[:, None] - rotate_half(query.float()) * sin[:, None]  # R_{-p} q
    plain = plain.view(batch, q_heads // GROUP, GROUP * count, DIM)
    stats = STATS.setdefault(self.layer_idx, {"n": 0, "sum": 0.0, "sq": 0.0})
    decay = SETUP["decay"]
    if decay is None:
        stats["sum"] = stats["sum"] + plain.sum(2)
        stats["sq"] = stats["sq"] + (plain**2).sum(2)
        stats["n"] += GROUP * count
    else:
        for i in range(count):
            w = decay ** (count - 1 - i)  # chunk of one token in this probe
            part = plain.view(batch, -1, GROUP, count, DIM)[:, :, :, i]
            stats["sum"] = stats["sum"] * decay + w * part.mean(2)
            stats["sq"] = stats["sq"] * decay + w * (part**2).mean(2)
            stats["n"] = stats["n"] * decay + w
    return attend(self, query, positions, full=full, **options)


def with_keys(self, next_pos):
    HANDED["keys"], HANDED["layer"] = self.keys, self.layer_idx
    return slot_state(self, next_pos)


layer_mod.KVLayer._attend = watching_attend
layer_mod.KVLayer.slot_state = with_keys


@dataclass(frozen=True)
class Expected(Policy):
    budget: int = 1
    recent: int = 0
    horizon: int = 512
    variance: bool = False

    def capacity(self, prompt_len):
        return tokens_of(self.budget, prompt_len)

    def priority(self, state):
        stats = STATS[HANDED["layer"]]
        mean = stats["sum"] / stats["n"]  # [B, H, D]
        var = (stats["sq"] / stats["n"] - mean**2).clamp(min=0)
        t = state.next_pos.view(-1, 1)  # [B, 1]
        cos, sin = angles(t + torch.arange(1, self.horizon + 1))  # [B, horizon, D]
        future = mean * cos.mean(1)[:, None] + rotate_half(mean) * sin.mean(1)[:, None]  # mean_j R_{t+j} mu
        keys = HANDED["keys"].float()  # [B, H, S, D]
        logit = (keys @ future[..., None]).squeeze(-1) / math.sqrt(DIM)
        if self.variance:  # rotation mixes pairs (i, i + D/2); their variances averaged as one
            pair = 0.5 * (var + torch.cat((var[..., DIM // 2 :], var[..., : DIM // 2]), -1))
            logit = logit + 0.5 * (keys**2 @ pair[..., None]).squeeze(-1) / DIM
        return torch.where(state.pos >= state.next_pos - self.recent, float("inf"), logit)


windows = text_windows(tok, None, n=n, length=length, seed=seed)
cap = int(budget * length)


def policy(name):
    if name == "h2o":
        SETUP["decay"] = None
        return H2O(budget=cap)
    kind, stat, horizon, share = name.split("_")
    SETUP["decay"] = None if stat == "mean" else float(stat[3:])
    return Expected(budget=cap, recent=round(cap * float(share[1:])), horizon=int(horizon[1:]), variance=kind == "eav")


with torch.no_grad():
    full_ppl = perplexity_stats(stream_nll(model, windows, "full", None))["ppl"]
    print(f"seed {seed}, {n} x {length}: full ppl {full_ppl:.3f}", flush=True)
    for name in sys.argv[5].split(","):
        begin, nll = time.time(), []
        for window in windows:
            STATS.clear()
            ids = window.view(1, -1)
            cache = KVCache(policy(name), prefill_chunk=1, compile_kernel=False)
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none"))
        ppl = math.exp(torch.cat(nll).double().mean())
        print(
            f"{name:22s} budget {budget:g}  ppl {ppl:.3f}  {100 * (ppl / full_ppl - 1):+.1f} %"
            f"  {time.time() - begin:.0f}s",
            flush=True,
        )

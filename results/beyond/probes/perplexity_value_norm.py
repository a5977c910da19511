"""Streaming perplexity (token by token) of H2O ranking by attention x value norm (VATP: Guo et al. 2024,
"Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also
Matters", arXiv 2406.12335). Probe: the layer's value norms are handed to the policy in this process only.

    python results/beyond/probes/perplexity_value_norm.py N L BUDGET variant[,variant...]
"""
import math
import sys
import time
from dataclasses import dataclass

import torch

import h2o_kv
import h2o_kv.layer as layer_mod
from h2o_kv import H2O, KVCache
from h2o_kv.eval.perplexity import text_windows
from h2o_kv.policies import Sinks

torch.set_num_threads(1)
n, length, budget = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
NORMS = {}
slot_state = layer_mod.KVLayer.slot_state


def with_norms(self, next_pos):
    NORMS["value"] = self.values.float().norm(dim=-1)  # [B, H, S]
    return slot_state(self, next_pos)


layer_mod.KVLayer.slot_state = with_norms


@dataclass(frozen=True)
class ValueNormH2O(H2O):
    power: float = 1.0  # rank by score x |v|^power (recent tokens stay protected)

    def priority(self, state):
        priority = super().priority(state)
        return torch.where(torch.isinf(priority), priority, priority * NORMS["value"] ** self.power)


model, tok = h2o_kv.load_model("smollm2-135m")
windows = text_windows(tok, None, n=n, length=length, seed=0)
cap = int(budget * length)
variants = {
    "h2o": H2O(budget=cap),
    "vatp": ValueNormH2O(budget=cap),
    "vatp_sinks": Sinks(ValueNormH2O(budget=cap)),
    "vatp_sq": ValueNormH2O(budget=cap, power=2.0),
    "vatp_recent0.75": ValueNormH2O(budget=cap, recent=int(cap * 0.75)),
}
for name in sys.argv[4].split(","):
    policy, begin, nll = variants[name], time.time(), []
    with torch.no_grad():
        for window in windows:
            ids = window.view(1, -1)
            logits = model(ids, past_key_values=KVCache(policy, prefill_chunk=1), use_cache=True).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none"))
    print(f"{name:18s} budget {budget:g}  ppl {math.exp(torch.cat(nll).mean()):.3f}  {time.time() - begin:.0f}s", flush=True)

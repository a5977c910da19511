"""One layer's steady decode step (H2O at 20 % of 4096 tokens, batch 4, SmolLM2's 3 KV heads x 3 queries,
head size 64), h2o-kv's `KVLayer` against the same operations written as one minimal function (probe).

Ten layers are prefilled with random keys and queries, repeated to batch 4, decoded 3 steps, and then each
"step" runs the ten layers once with the same new token; the medians of 20 steps per round are printed per
layer. The minimal layer (`Minimal`, this file only) writes the new token into the slot the last eviction
left, attends with baddbmm / softmax / bmm, adds the scores and evicts with the same ranking: what the
library's layer would cost without its Python bookkeeping. Its kept positions and scores are compared.

    python results/bench-static/probes/decode_layer.py
"""

import statistics

import torch
from layer_steps import B, D, G, H, build, step

from h2o_kv import H2O
from h2o_kv.layer import KVLayer

INF = float("inf")


class Minimal(KVLayer):
    def forward_attention(self, query, attention_mask, *, scaling, window=None, softcap=None, config=None):
        slots, self.vacant = self.vacant[0], None
        keys, values = self.pending
        self.pending = None
        slots_s = self.pos.shape[-1]
        qpos = self.next_pos
        self.next_pos = qpos + 1
        self.seen += 1
        index = slots[..., None].expand(-1, -1, -1, D)
        self.keys.scatter_(2, index, keys)
        self.values.scatter_(2, index, values)
        self.pos.scatter_(2, slots, qpos.expand(B, H, 1))
        pos = self.pos
        valid = pos >= 0
        bias = torch.where(valid, 0.0, -INF).view(B * H, 1, slots_s).expand(B * H, G, slots_s)
        logits = torch.baddbmm(bias, query.reshape(B * H, G, D), self.keys.view(B * H, slots_s, D).mT, alpha=scaling)
        probs = torch.softmax(logits, dim=-1)
        out = torch.bmm(probs, self.values.view(B * H, slots_s, D))
        self.score.add_(probs.view(B, H, G, slots_s).sum(2))
        recent = self.policy.split(self.prompt_len)[1]
        over = valid.sum(-1, keepdim=True) > self.capacity.view(-1, 1, 1)
        priority = torch.where(pos >= qpos + 1 - recent, INF, self.score)
        priority = torch.where(valid, priority, torch.where(over, INF, -INF))
        oldest = torch.where(priority == priority.amin(-1, keepdim=True), pos, 1 << 62)
        victim = oldest.argmin(-1, keepdim=True)
        pos.scatter_(2, victim, -1)
        self.score.scatter_(2, victim, 0.0)
        self.vacant = (victim, pos)
        return out.view(B, 1, H * G, D)


with torch.inference_mode():
    library, minimal = build(H2O(budget=0.2), KVLayer), build(H2O(budget=0.2), KVLayer)
    for layer in minimal:
        layer.__class__ = Minimal
    for r in range(4):
        a = statistics.median(step(library) for _ in range(20))
        b = statistics.median(step(minimal) for _ in range(20))
        print(f"round {r}: KVLayer {a:.0f} us per layer, minimal {b:.0f} us", flush=True)
    same = all(torch.equal(x.pos, y.pos) and torch.allclose(x.score, y.score) for x, y in zip(library, minimal))
    print(f"same kept positions and scores: {same} (torch threads {torch.get_num_threads()})")

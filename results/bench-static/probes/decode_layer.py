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
import time

import torch

from h2o_kv import H2O, KVCache
from h2o_kv.layer import KVLayer

B, H, G, D, N, LAYERS, INF = 4, 3, 3, 64, 4096, 10, float("inf")


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


def build():
    torch.manual_seed(0)
    cache = KVCache(H2O(budget=0.2))
    layers = []
    for i in range(LAYERS):
        layer = KVLayer(cache.settings, i)
        layer.update(torch.randn(1, H, N, D), torch.randn(1, H, N, D))
        layer.forward_attention(torch.randn(1, H * G, N, D), None, scaling=D**-0.5)
        layer.batch_repeat_interleave(B)
        for _ in range(3):
            layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
            layer.forward_attention(torch.randn(B, H * G, 1, D), None, scaling=D**-0.5)
        layers.append(layer)
    return layers


new = [(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H * G, 1, D)) for _ in range(LAYERS)]


def step(layers):
    begin = time.perf_counter()
    for layer, (k, v, q) in zip(layers, new):
        layer.update(k, v)
        layer.forward_attention(q, None, scaling=D**-0.5)
    return (time.perf_counter() - begin) / LAYERS * 1e6


with torch.inference_mode():
    library, minimal = build(), build()
    for layer in minimal:
        layer.__class__ = Minimal
    for r in range(4):
        a = statistics.median(step(library) for _ in range(20))
        b = statistics.median(step(minimal) for _ in range(20))
        print(f"round {r}: KVLayer {a:.0f} us per layer, minimal {b:.0f} us", flush=True)
    same = all(torch.equal(x.pos, y.pos) and torch.allclose(x.score, y.score) for x, y in zip(library, minimal))
    print(f"same kept positions and scores: {same} (torch threads {torch.get_num_threads()})")

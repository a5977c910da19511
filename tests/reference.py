"""A literal, slow reading of docs/eviction.md for one attention layer: the oracle tests compare to.

Plain Python lists per KV head and float64 maths; nothing shared with the library's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Token:
    pos: int
    score: float = 0.0
    last: float = 0.0


def choose_victim(rule: str, kept: list[Token], params: dict, next_pos: int = 0) -> Token:
    """The token the policy table removes next (never a protected sink: params["protect"])."""
    oldest_first = [tok for tok in sorted(kept, key=lambda tok: tok.pos) if tok.pos >= params.get("protect", 0)]
    if rule == "local":
        return oldest_first[0]
    if rule == "streaming":
        return next(tok for tok in oldest_first if tok.pos >= params["sinks"])
    if rule in ("h2o", "snapkv"):
        older = [tok for tok in oldest_first if tok.pos < next_pos - params["recent"]]
        if params.get("normalize"):
            return min(older, key=lambda tok: (tok.score / (next_pos - tok.pos), tok.pos))
        return min(older, key=lambda tok: (tok.score, tok.pos))
    if rule == "tova":
        return min(oldest_first, key=lambda tok: (tok.last, tok.pos))
    raise ValueError(rule)


def pooled_victim_head(rule: str, kept: list[list[Token]], params: dict, next_pos: int) -> int:
    """AdaKV: the head whose own next victim ranks lowest over the whole layer (ties: older, then lower head)."""
    best = None
    for h, tokens in enumerate(kept):
        try:
            tok = choose_victim(rule, tokens, params, next_pos)
        except (ValueError, StopIteration):  # nothing this head may lose (all protected)
            continue
        if rule in ("h2o", "snapkv"):
            key = (tok.score / (next_pos - tok.pos) if params.get("normalize") else tok.score, tok.pos, h)
        else:
            key = (tok.last, tok.pos, h) if rule == "tova" else (tok.pos, h)
        best = min(best, key) if best is not None else key
    return best[-1]


def reference_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[int],
    rule: str,
    capacity: int,
    params: dict,
    window: int | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """One sequence: q [Hq, T, D], k/v [H, T, D], fed in calls of `chunks` tokens.

    Returns the attention output [T, Hq, D] and the kept positions per KV head at the end.
    """
    q, k, v = q.double(), k.double(), v.double()
    q_heads, total, dim = q.shape
    kv_heads = k.shape[0]
    group = q_heads // kv_heads
    scale = dim**-0.5
    out = torch.zeros(total, q_heads, dim, dtype=torch.float64)
    kept: list[list[Token]] = [[] for _ in range(kv_heads)]
    start = 0
    observe, pool, decay = params.get("observe"), params.get("pool", 1), params.get("decay", 1.0)
    for size in chunks:
        new = range(start, start + size)
        observed = size > 1 and observe is not None
        scoring = [t for t in new if not observed or t > new[-1] - observe]
        pooled: list[dict[int, float]] = []
        for h in range(kv_heads):
            for tok in kept[h]:
                tok.score *= decay**size
            kept[h].extend(Token(t) for t in new)
            gained = {tok.pos: 0.0 for tok in kept[h]}
            for tok in kept[h]:
                tok.last = 0.0
            for t in new:
                visible = [tok for tok in kept[h] if tok.pos <= t and (window is None or tok.pos > t - window)]
                for g in range(group):
                    head = h * group + g
                    logits = [float(q[head, t] @ k[h, tok.pos]) * scale for tok in visible]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    total_w = sum(weights)
                    for tok, w in zip(visible, weights):
                        p = w / total_w
                        out[t, head] += p * v[h, tok.pos]
                        if t in scoring:
                            gained[tok.pos] += p
                        if t == new[-1]:
                            tok.last += p / group
            in_order = sorted(kept[h], key=lambda tok: tok.pos)
            reach = pool // 2 if observed else 0  # max over neighbours among kept tokens
            pooled.append(
                {
                    tok.pos: max(gained[other.pos] for other in in_order[max(0, i - reach) : i + reach + 1])
                    for i, tok in enumerate(in_order)
                }
            )
        if observed and params.get("shared"):  # the call's new tokens: the max over the layer's KV heads
            for t in new:
                best = max(head[t] for head in pooled)
                for head in pooled:
                    head[t] = best
        for h in range(kv_heads):
            for tok in kept[h]:
                tok.score += pooled[h][tok.pos]
            if window is not None:
                kept[h] = [tok for tok in kept[h] if tok.pos > new[-1] + 1 - window]
            while not params.get("pooled") and len(kept[h]) > capacity:
                kept[h].remove(choose_victim(rule, kept[h], params, next_pos=new[-1] + 1))
        while params.get("pooled") and sum(map(len, kept)) > capacity * kv_heads:  # AdaKV: the layer's lowest
            h = pooled_victim_head(rule, kept, params, next_pos=new[-1] + 1)
            kept[h].remove(choose_victim(rule, kept[h], params, next_pos=new[-1] + 1))
        start += size
    return out, [sorted(tok.pos for tok in head) for head in kept]

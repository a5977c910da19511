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


def choose_victim(rule: str, kept: list[Token], params: dict) -> Token:
    """The token the policy table removes next."""
    oldest_first = sorted(kept, key=lambda tok: tok.pos)
    if rule == "local":
        return oldest_first[0]
    if rule == "streaming":
        return next(tok for tok in oldest_first if tok.pos >= params["sinks"])
    if rule == "h2o":
        older = oldest_first[: len(oldest_first) - params["recent"]]
        return min(older, key=lambda tok: (tok.score, tok.pos))
    if rule == "tova":
        return min(oldest_first, key=lambda tok: (tok.last, tok.pos))
    raise ValueError(rule)


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
    for size in chunks:
        new = range(start, start + size)
        for h in range(kv_heads):
            kept[h].extend(Token(t) for t in new)
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
                        tok.score += p
                        if t == new[-1]:
                            tok.last += p / group
            if window is not None:
                kept[h] = [tok for tok in kept[h] if tok.pos > new[-1] + 1 - window]
            while len(kept[h]) > capacity:
                kept[h].remove(choose_victim(rule, kept[h], params))
        start += size
    return out, [sorted(tok.pos for tok in head) for head in kept]

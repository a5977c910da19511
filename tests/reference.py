"""A literal, slow reading of docs/eviction.md for one attention layer: the oracle tests compare to.

Plain Python lists per KV head and float64 maths; nothing shared with the library's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEAR_TIE = 1e-5  # KeyDiff cosines this close are a tie the library's float32 may break either way: with two held
# keys the two cosines to their mean are equal in exact maths, so the spec's "ties go to the oldest" is rounding there


@dataclass
class Token:
    pos: int
    score: float = 0.0
    last: float = 0.0
    distinct: float = 0.0  # KeyDiff: minus the cosine of its key to the anchor, set when a call's eviction starts


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
    if rule == "keydiff":
        older = [tok for tok in oldest_first if tok.pos < next_pos - params["recent"]]
        victim = min(older, key=lambda tok: (tok.distinct, tok.pos))
        if any(tok is not victim and abs(tok.distinct - victim.distinct) < NEAR_TIE for tok in older):
            params["near_ties"] = params.get("near_ties", 0) + 1  # float32 rounding may pick the other one
        return victim
    if rule == "kvzip":
        protected = kvzip_protected(params, next_pos)
        return min((tok for tok in oldest_first if tok.pos < protected), key=lambda tok: (tok.score, tok.pos))
    raise ValueError(rule)


def kvzip_protected(params: dict, next_pos: int) -> int:
    """KVzip: positions from this one on are kept. The newest `recent` after the context (none of the context); with
    a `window`, the newest `window` more, all of it at most `half` (ceil(capacity / 2))."""
    newest = min(params["recent"], max(0, next_pos - params["context"]))
    if params.get("window"):
        newest = min(newest + params["window"], params["half"])
    return next_pos - newest


def rank_key(rule: str, tok: Token, params: dict, next_pos: int) -> tuple:
    """What a victim is ranked by across heads (AdaKV): its priority, then its age."""
    if rule in ("h2o", "snapkv", "kvzip"):
        return (tok.score / (next_pos - tok.pos) if params.get("normalize") else tok.score, tok.pos)
    return (tok.last, tok.pos) if rule == "tova" else (tok.pos,)


def pooled_victim_head(rule: str, kept: list[list[Token]], params: dict, next_pos: int) -> int:
    """AdaKV: the head whose own next victim ranks lowest over the whole layer (ties: older, then lower head)."""
    best = None
    for h, tokens in enumerate(kept):
        try:
            tok = choose_victim(rule, tokens, params, next_pos)
        except (ValueError, StopIteration):  # nothing this head may lose (all protected)
            continue
        key = (*rank_key(rule, tok, params, next_pos), h)
        best = min(best, key) if best is not None else key
    return best[-1]


def set_distinct(tokens: list[Token], keys: torch.Tensor) -> None:
    """KeyDiff: each token's -cos(key, anchor), the anchor the mean of the held keys scaled to unit length."""
    units = [keys[tok.pos] / max(float(keys[tok.pos].norm()), 1e-12) for tok in tokens]
    anchor = sum(units) / len(units)
    for tok, unit in zip(tokens, units):
        tok.distinct = -float(unit @ anchor) / max(float(anchor.norm()), 1e-12)


def reference_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[int],
    rule: str,
    capacity: int,
    params: dict,
    window: int | None = None,
    kept: list[list[Token]] | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, list[list[int]]]:
    """One sequence: q [Hq, T, D], k/v [H, T, D], fed in calls of `chunks` tokens from position `start` on, with
    the tokens `kept` per KV head before them (none by default).

    Returns the attention output [T, Hq, D] (zero before `start`) and the kept positions per KV head at the end.
    """
    q, k, v = q.double(), k.double(), v.double()
    q_heads, total, dim = q.shape
    kv_heads = k.shape[0]
    group = q_heads // kv_heads
    scale = dim**-0.5
    out = torch.zeros(total, q_heads, dim, dtype=torch.float64)
    kept = [[] for _ in range(kv_heads)] if kept is None else kept
    observe, pool, decay = params.get("observe"), params.get("pool", 1), params.get("decay", 1.0)
    base, grown = capacity, params.get("prompt_done", False)  # `headroom`: held past the budget after the prompt
    for index, size in enumerate(chunks):
        if "grown_from" in params:  # the chunk from which it counts (a call's chunks are not calls)
            grown = index >= params["grown_from"]
        else:
            grown = grown or (index > 0 and size == 1)  # a one-token call after the prompt completes it
        capacity = base + params.get("headroom", 0) if grown else base
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
            if rule == "keydiff":  # the anchor of the tokens held now, before any of this call's evictions
                set_distinct(kept[h], k[h])
            while not params.get("pooled") and len(kept[h]) > capacity:
                kept[h].remove(choose_victim(rule, kept[h], params, next_pos=new[-1] + 1))
        while params.get("pooled") and sum(map(len, kept)) > capacity * kv_heads:  # AdaKV: the layer's lowest
            h = pooled_victim_head(rule, kept, params, next_pos=new[-1] + 1)
            kept[h].remove(choose_victim(rule, kept[h], params, next_pos=new[-1] + 1))
        start += size
    return out, [sorted(tok.pos for tok in head) for head in kept]


def reference_reconstruction(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    capacity: int,
    params: dict,
    window: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[list[Token]]]:
    """KVzip's pass for one sequence (docs/eviction.md): the context q [Hq, L, D], k/v [H, L, D] held whole, then
    each piece (q [Hq, m, D], k/v [H, m, D], at positions L .. L + m - 1) attending to the context and causally to
    itself; a context token's score is the most probability any piece's query of its group gave it. Then each KV
    head keeps its `capacity` best (the sliding window first). Returns the context's outputs [L, Hq, D], each
    piece's [m, Hq, D], and the kept tokens per KV head (with their scores, for `reference_layer(kept=...)`)."""
    q, k, v = q.double(), k.double(), v.double()
    q_heads, length, dim = q.shape
    kv_heads = k.shape[0]
    group = q_heads // kv_heads
    scale = dim**-0.5

    def attend(query, keys, values):
        logits = [float(query @ key) * scale for key in keys]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        probs = [w / sum(weights) for w in weights]
        return sum(p * value for p, value in zip(probs, values)), probs

    def seen(t, pos):
        return pos <= t and (window is None or pos > t - window)

    context_out = torch.zeros(length, q_heads, dim, dtype=torch.float64)
    peak = [[0.0] * length for _ in range(kv_heads)]
    for head in range(q_heads):
        h = head // group
        for t in range(length):
            visible = [j for j in range(length) if seen(t, j)]
            context_out[t, head], _ = attend(q[head, t], [k[h, j] for j in visible], [v[h, j] for j in visible])
    piece_outs = []
    for pq, pk, pv in pieces:
        pq, pk, pv = pq.double(), pk.double(), pv.double()
        out = torch.zeros(pq.shape[1], q_heads, dim, dtype=torch.float64)
        for head in range(q_heads):
            h = head // group
            for i in range(pq.shape[1]):
                t = length + i
                old = [j for j in range(length) if seen(t, j)]
                new = [j for j in range(i + 1) if seen(t, length + j)]
                keys = [k[h, j] for j in old] + [pk[h, j] for j in new]
                values = [v[h, j] for j in old] + [pv[h, j] for j in new]
                out[i, head], probs = attend(pq[head, i], keys, values)
                for j, p in zip(old, probs):
                    peak[h][j] = max(peak[h][j], p)
        piece_outs.append(out)
    if params.get("window"):  # the context's last queries pick a share of each row first (KVzip's `window`)
        picks = window_picks(q, k, length, params, window, pooled=bool(params.get("pooled")),
                             capacity=params.get("pick_capacity", capacity))  # fmt: skip
        peak = [[peak[h][j] + 2.0 * ((h, j) in picks) for j in range(length)] for h in range(kv_heads)]
    kept = [[Token(j, score=peak[h][j]) for j in range(length) if window is None or j > length - window]
            for h in range(kv_heads)]  # fmt: skip
    for h in range(kv_heads):
        while not params.get("pooled") and len(kept[h]) > capacity:
            kept[h].remove(choose_victim("kvzip", kept[h], params, next_pos=length))
    while params.get("pooled") and sum(map(len, kept)) > capacity * kv_heads:
        h = pooled_victim_head("kvzip", kept, params, next_pos=length)
        kept[h].remove(choose_victim("kvzip", kept[h], params, next_pos=length))
    return context_out, piece_outs, kept


def window_picks(q: torch.Tensor, k: torch.Tensor, length: int, params: dict, window: int | None, *, pooled: bool,
                 capacity: int) -> set[tuple[int, int]]:  # fmt: skip
    """The (KV head, position) slots the context's last `params["window"]` queries pick: per KV head (a pooled layer:
    over all its heads together), the floor(share x capacity) (at least 1; a pooled row's capacity is heads x
    capacity) given the most probability by any of those queries of the head's group, ties to the older position,
    then the lower head."""
    q_heads, kv_heads = q.shape[0], k.shape[0]
    group, scale = q_heads // kv_heads, q.shape[-1] ** -0.5
    peak = {}
    for head in range(q_heads):
        h = head // group
        for t in range(max(0, length - params["window"]), length):
            visible = [j for j in range(length) if j <= t and (window is None or j > t - window)]
            logits = [float(q[head, t].double() @ k[h, j].double()) * scale for j in visible]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            for j, w in zip(visible, weights):
                peak[(h, j)] = max(peak.get((h, j), 0.0), w / sum(weights))
    rows = [[(h, j) for h in range(kv_heads) for j in range(length)]] if pooled else \
        [[(h, j) for j in range(length)] for h in range(kv_heads)]  # fmt: skip
    count = max(1, math.floor(params["share"] * capacity * (kv_heads if pooled else 1)))
    picked = set()
    for row in rows:
        ranked = sorted(row, key=lambda slot: (-peak.get(slot, 0.0), slot[1], slot[0]))
        picked.update(ranked[:count])
    return picked


def reference_whole_cache(layers: list[list[list[Token]]], capacity: int,
                          protect_from: int | None = None) -> list[list[list[Token]]]:  # fmt: skip
    """KVzip's whole-cache allocation when its pass ends (docs/eviction.md): `layers` holds each layer's context
    tokens per KV head with their reconstruction scores (`reference_reconstruction` with nothing removed). Each
    (layer, head) keeps its best-ranked token (ties: the oldest; a protected token, at `protect_from` or after,
    ranks above any score); of the others the lowest score goes first, ties to the oldest position, then the lower
    layer, then the lower head, never a protected one, until every layer together holds `capacity` x heads x
    layers. Returns what each (layer, head) keeps."""
    kept = [[list(head) for head in layer] for layer in layers]

    def protected(tok: Token) -> bool:
        return protect_from is not None and tok.pos >= protect_from

    best = {(i, h): max(head, key=lambda tok: (protected(tok), tok.score if not protected(tok) else 0.0, -tok.pos)).pos
            for i, layer in enumerate(kept) for h, head in enumerate(layer)}  # fmt: skip
    total = capacity * sum(len(layer) for layer in kept)
    while sum(len(head) for layer in kept for head in layer) > total:
        candidates = [(tok.score, tok.pos, i, h) for i, layer in enumerate(kept) for h, head in enumerate(layer)
                      for tok in head if tok.pos != best[(i, h)] and not protected(tok)]  # fmt: skip
        if not candidates:
            break
        _, pos, i, h = min(candidates)
        kept[i][h] = [tok for tok in kept[i][h] if tok.pos != pos]
    return kept

"""KVzip's context-reconstruction pass over a cache (Kim et al., 2025, arXiv 2505.23416): hold, score, rank.

A policy that `reconstructs` (KVzip) ranks a context by how much the model needs each token to repeat it, which
no prompt's own attention says. `KVCache.reconstruction()` gives the pass; `h2o_kv.compress` (runtime/compress.py)
drives it:

    with cache.reconstruction() as rec:
        model(context, past_key_values=cache)        # 1. held: every token kept, unscored, nothing evicted
        for piece in pieces:                          # "Repeat the previous context exactly." + a chunk of it
            with rec.scoring():
                model(piece, past_key_values=cache)   # 2. a scoring call: attended, scored, then dropped
    # 3. leaving the block: each (sequence, KV head) keeps its capacity of best-scored tokens (the policy's rule)

A scoring call's n new tokens take the next n free slots at the positions after the context (every call starts
there again: the pieces are not part of the sequence) and attend to the kept tokens and causally to each other,
as a prompt's tokens do (`attend_peak`). Each kept slot's score becomes the most attention it has received from
any query of the pass, over its group's query heads (KVzip's max). The call's slots are then emptied and the
layer's counts (`used`, `kept_bound`, `seen`, `next_pos`) are as before it, so the cache holds at most the context
plus one piece: the pass's extra memory is a chunk, not a second copy of the context, and it costs about one more
prefill. KVzip's own code normalises a chunk's probabilities over that chunk's slice of the context (and a few
sinks) for speed; here they are the model's own attention probabilities, over everything a query sees.

With `KVzip(window=w)` the held calls' last w queries (across calls: the context's last w) are kept per layer, and
when the pass ends they rank the context first: in each row the `share` of its capacity they attend to most (the
most probability any of them gave a slot, as a scoring call's) gets 2 added to its score, above any probability,
before the ranking (`_pick_window`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from h2o_kv.cache.attend import (
    DEVICE_QUERY_BLOCK_ELEMENTS,
    QUERY_BLOCK_ELEMENTS,
    Slots,
    compute_dtype,
    hidden,
    stored_as,
)
from h2o_kv.cache.layer import eviction_ranks
from h2o_kv.cache.pooled import by_head
from h2o_kv.policies.kvzip import kvzip_of, ranks_whole_cache


class Reconstruction:
    """The pass over one cache: its `settings` (the layers find the pass there) and its `layers` (the list the
    cache fills as the model calls it). A context manager; `scoring()` marks the calls that score."""

    def __init__(self, settings, layers: list) -> None:
        policy = settings.policy
        if not policy.reconstructs:
            raise ValueError(
                f"{policy.describe()} ranks a prompt by its own attention: feed the context to the model with "
                "KVCache(policy); a reconstruction pass is KVzip's (h2o_kv.KVzip)"
            )
        if ranks_whole_cache(policy) and not policy.head_pooled:
            raise ValueError(
                f"{policy.describe()} ranks every head's tokens together: wrap it in AdaKV, whose pooled rows let a "
                "head keep what the ranking gives it (h2o_kv.build('kvzipwhole', budget))"
            )
        if settings.reconstruction is not None:
            raise ValueError("this KVCache is already in a reconstruction pass")
        if any(layer.is_initialized and layer.seen for layer in layers):
            raise ValueError("a reconstruction pass starts from an empty KVCache: use a new one")
        self.settings, self.layers = settings, layers
        self.scoring_now = False
        self.windows: dict[int, int | None] = {}  # each layer's sliding window (None: full attention)
        kvzip = kvzip_of(policy)  # a policy that reconstructs is a KVzip or wraps one
        self.window, self.share = kvzip.window, kvzip.share
        self.window_queries: dict[int, tuple] = {}  # each layer's last held queries: (q, positions, options)

    def __enter__(self) -> Reconstruction:
        for layer in self.layers:
            layer.reset()  # initialised by a refused call, perhaps for another batch: nothing seen
        self.settings.reconstruction = self
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.settings.reconstruction = None
        held, self.window_queries = self.window_queries, {}
        if kind is not None:  # a failed pass leaves an empty cache, never an unranked one over its capacity
            for layer in self.layers:
                layer.reset()
            return
        for layer in self.layers:
            if layer.is_initialized and layer.layer_idx in held:
                self._pick_window(layer, *held[layer.layer_idx])
        if ranks_whole_cache(self.settings.policy):  # one ranking over the full-attention layers: each one's capacity
            rank_whole_cache([layer for layer in self.layers if layer.is_initialized
                              and self.windows.get(layer.layer_idx) is None])  # fmt: skip
        for layer in self.layers:
            if layer.is_initialized:  # ranked as after a prompt (`added` > 1): the capacity's best, then compacted
                layer._evict(layer.next_pos, self.windows.get(layer.layer_idx), max(2, layer.kept_bound))

    @contextmanager
    def scoring(self) -> Iterator[Reconstruction]:
        """The calls inside score the held context and are not kept."""
        if not self.layers or not all(layer.is_initialized and layer.seen for layer in self.layers):
            raise ValueError("a reconstruction pass holds its context first: feed it to the model before scoring")
        for layer in self.layers:
            layer.decoded = True  # the context was the whole prompt: a fraction budget is final
        self.scoring_now = True
        try:
            yield self
        finally:
            self.scoring_now = False

    def attention(self, layer, query: torch.Tensor, attention_mask: torch.Tensor | None, *, scaling: float,
                  window: int | None, softcap: float | None) -> torch.Tensor | None:  # fmt: skip
        """`layer`'s call in the pass: the output [B, n, Hq, D] of a scoring call, None for a held one (the layer's
        own path, without scores or eviction)."""
        self.windows[layer.layer_idx] = window
        if not self.scoring_now:
            if self.window:
                self._keep_window(layer, query, attention_mask, scaling=scaling, window=window, softcap=softcap)
            return None
        keys, values = layer.pending
        layer.pending = None
        batch, n = query.shape[0], query.shape[2]
        if n < 2:
            raise ValueError("a scoring call brings a reconstruction prompt and its chunk: at least 2 new tokens")
        real, _ = layer.settings.padding.real_tokens(attention_mask, batch, n, query.device)
        qpos = torch.where(real, layer.next_pos.view(batch, 1) + real.cumsum(1) - 1, -1)
        used, bound = layer.used, layer.kept_bound
        first = layer._insert(keys, values, qpos)  # in order after every used slot (n > 1)
        x = query.to(compute_dtype(query.dtype, query.device))
        options = dict(scaling=scaling, window=window, softcap=softcap)
        memo = layer.settings.peaks
        if memo is None:
            out, by_head = _peak(layer, x, qpos, want_out=True, **options)
        else:  # a recorded pass, run or replayed: nothing is evicted, so a call's peak per head is every cache's
            kv, tokens = _head_slots(layer)
            key = (query.data_ptr(), tuple(query.shape), tokens)
            if memo.outputs or key not in memo.done:
                out, memo.done[key] = attend_peak(x, kv, qpos, width=tokens, want_out=memo.outputs, **options)
            if not memo.outputs:  # a replay drops the outputs
                out = x.new_zeros(batch, n, x.shape[1], layer.values.shape[-1])
            by_head = memo.done[key]
        peak = _row_order(layer, by_head)
        layer.score[..., :first] = torch.maximum(layer.score[..., :first], peak[..., :first])
        for name, empty in (("pos", -1), ("score", 0.0), ("last", 0.0)):  # the call's tokens are not kept
            if getattr(layer, name) is not None:
                getattr(layer, name)[..., first : layer.used] = empty
        layer.used, layer.kept_bound = used, bound
        return out.to(query.dtype)

    def _keep_window(self, layer, query: torch.Tensor, attention_mask: torch.Tensor | None, **options) -> None:
        """Keep a held call's last `window` queries [B, Hq, w, D] and their positions [B, w] (-1: padding) with
        those kept from the layer's calls before it, so the context's last `window` are kept whatever its chunks."""
        batch, n = query.shape[0], query.shape[2]
        real, _ = layer.settings.padding.real_tokens(attention_mask, batch, n, query.device)
        qpos = torch.where(real, layer.next_pos.view(batch, 1) + real.cumsum(1) - 1, -1)[:, -self.window :]
        q = query[:, :, -self.window :].to(compute_dtype(query.dtype, query.device))
        before = self.window_queries.get(layer.layer_idx)
        if before is not None:
            q = torch.cat([before[0], q], 2)[:, :, -self.window :]
            qpos = torch.cat([before[1], qpos], 1)[:, -self.window :]
        self.window_queries[layer.layer_idx] = (q, qpos, options)

    def _pick_window(self, layer, q: torch.Tensor, qpos: torch.Tensor, options: dict) -> None:
        """In each row of `layer` (a (sequence, KV head), or a head-pooled row), the floor(`share` x capacity) slots
        (at least 1) the window's queries gave the most probability get 2 added to their score, above any
        probability; ties go to the earlier slot (held calls fill slots in position order, a pooled row token by
        token, heads in order)."""
        used = layer.used
        peak = _row_order(layer, _peak(layer, q, qpos, want_out=False, **options)[1])[..., :used]
        peak = torch.where(layer.pos[..., :used] >= 0, peak, -1.0)
        picks = (self.share * layer.capacity.view(-1, 1, 1).float()).floor().clamp(min=1)
        order = peak.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(used, device=order.device).expand_as(order))
        layer.score[..., :used] += ((rank < picks) & (peak >= 0)).float() * 2.0


@dataclass
class PassPeaks:
    """`Settings.peaks`: the peak attention per KV head ([B, H, tokens]) of each scoring call of one recorded KVzip
    pass, shared by the caches that run or replay it (studies/eval/shared.py: `record_pass`, `replay_pass`). Nothing
    is evicted during a pass, so a call's peak is the same in every cache whatever its budget or layout (per head,
    or head-pooled: the same numbers in the row's order), and is computed once. `outputs`: the calls' outputs are
    computed (the recording's run, whose layers need them); a replay drops them and computes only what it lacks."""

    done: dict = field(default_factory=dict)
    outputs: bool = False


def _peak(layer, q: torch.Tensor, qpos: torch.Tensor, **options) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`attend_peak` over `layer`'s slots during the pass, per KV head ([B, H, tokens]; `_row_order` puts it in the
    layer's slot order)."""
    kv, tokens = _head_slots(layer)
    return attend_peak(q, kv, qpos, width=tokens, **options)


def _head_slots(layer) -> tuple[Slots, int]:
    """`layer`'s slots during the pass as a row per KV head [B, H, tokens, ...], and the tokens. A head-pooled row
    (AdaKV) holds the context and this call token-major, each token's heads side by side in order (pooled.py): it is
    read by head (a copy in a per-head layout, so its peak is a per-head layer's number for number), each query head
    against its own head's slots only (the row as one masked head would multiply every query head by every head's
    slots)."""
    if layer.head is None:
        return Slots(layer.keys, layer.values, layer.pos, layer.key_scale, layer.value_scale), layer.used
    heads, width = layer.kv_heads, layer.used
    if width % heads:
        raise RuntimeError(f"a pooled row in KVzip's pass holds whole tokens: {width} slots for {heads} heads")
    fields = (layer.keys, layer.values, layer.pos, layer.key_scale, layer.value_scale)
    return Slots(*(None if t is None else by_head(t, width, heads).contiguous() for t in fields)), width // heads


def _row_order(layer, peak: torch.Tensor) -> torch.Tensor:
    """A per-head peak [B, H, tokens] in `layer`'s slot order: as is, or a head-pooled row's [B, 1, tokens x H]."""
    return peak if layer.head is None else peak.transpose(1, 2).reshape(peak.shape[0], 1, -1)


def attend_peak(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, *, width: int, scaling: float, window: int | None,
                softcap: float | None, want_out: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """Attention of queries q [B, Hq, n, D] at positions qpos [B, n] (-1: padding) over the first `width` slots of
    `kv` (each sees the slots at positions <= its own, as `attend.hidden` says): the output [B, n, Hq, D] (None
    without `want_out`: the values are not read) and, per slot, the most probability any query of the group gave
    it, [B, H, width] float32. Queries go in blocks, so no [n x width] matrix of every head is materialised."""
    keys, values = stored_as(kv, q.dtype)
    keys, values = keys[:, :, :width], values[:, :, :width]
    batch, q_heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    q = (q * scaling).view(batch, kv_heads, group, n, dim)
    elements = QUERY_BLOCK_ELEMENTS if q.device.type == "cpu" else DEVICE_QUERY_BLOCK_ELEMENTS
    block = max(1, elements // max(1, batch * q_heads * width))
    peak = torch.zeros(batch, kv_heads, width, dtype=torch.float32, device=q.device)
    outputs = []
    for start in range(0, n, block):
        stop = min(n, start + block)
        logits = torch.matmul(q[:, :, :, start:stop].reshape(batch, kv_heads, -1, dim), keys.mT)
        logits = logits.view(batch, kv_heads, group, stop - start, width).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits.masked_fill_(hidden(kv, qpos, window, start, stop, width), float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a padding query sees nothing
        torch.maximum(peak, probs.amax(dim=(2, 3)), out=peak)
        if want_out:
            out = torch.matmul(probs.view(batch, kv_heads, -1, width).to(values.dtype), values)
            outputs.append(out.view(batch, q_heads, stop - start, values.shape[-1]))
    if not want_out:
        return None, peak
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), peak


def rank_whole_cache(layers: list) -> None:
    """KVzip's own allocation (its paper's default; kvpress's `layerwise=False`): the context's tokens of every
    (layer, KV head) of `layers` (head-pooled rows) ranked together, per sequence. The lowest priorities go first,
    ties to the oldest position, then the lower layer, then the lower head, until each sequence holds the sum of the
    layers' capacities; each (layer, KV head) keeps at least its best-scored token. Each layer's capacity becomes
    what it holds, so decoding afterwards keeps each layer at its share; a sequence that lost nothing (its context
    within the budget: a short prompt under a token budget) keeps each layer's own capacity. Frees only: the
    caller's eviction then finds nothing over capacity and compacts."""
    if not layers:
        return
    valid, priority, protect = [], [], []
    for layer in layers:
        ok = layer.pos >= 0  # [B, 1, S]
        rank = torch.where(ok, layer.policy.priority(layer.slot_state(layer.next_pos)), float("-inf"))
        heads = torch.arange(layer.kv_heads, device=layer.device).view(1, -1, 1)
        best = torch.where(layer.head.long() == heads, rank, float("-inf")).argmax(-1)  # [B, heads]: each head's best
        kept = torch.zeros_like(ok).scatter_(-1, best.unsqueeze(1), True)
        valid.append(ok[:, 0])
        priority.append(torch.where(kept, float("inf"), rank)[:, 0])
        protect.append(kept[:, 0])
    valid_all, priority_all, protect_all = torch.cat(valid, -1), torch.cat(priority, -1), torch.cat(protect, -1)
    pos_all = torch.cat([layer.pos[:, 0] for layer in layers], -1)
    budget = sum(layer.capacity.view(-1) for layer in layers)  # [B]
    free = (valid_all & ~protect_all).sum(-1)
    excess = torch.minimum(valid_all.sum(-1) - budget, free).clamp(min=0)  # [B]
    evict = valid_all & (eviction_ranks(valid_all, pos_all, priority_all) < excess.unsqueeze(-1))
    start = 0
    for layer in layers:
        width = layer.pos.shape[-1]
        layer._free(evict[:, start : start + width].unsqueeze(1))
        start += width
        held = (layer.pos >= 0).sum(-1).view(-1, 1)  # [B, 1]
        own = layer.capacity.view(-1, 1).to(held.dtype)  # a sequence that lost nothing keeps every layer's own
        held = torch.where((excess > 0).view(-1, 1), held, own)
        layer.capacity = held.to(layer.capacity.dtype)
        layer.max_capacity, layer.min_capacity = int(held.max()), int(held.min())

"""A head-pooled layer (Ada-KV's storage): one row of slots per sequence, shared by the layer's KV heads.

`KVLayer` stores [batch, KV heads, slots], so every head holds as many slots as the fullest one. For
`AdaKV` the heads of a layer share `heads x capacity` slots, as unevenly as their scores say, and
the memory must follow the total, not the largest head. This layer stores the same tensors with a
single "virtual" KV head, [batch, 1, heads x (capacity + 1)], and tags each slot with its real head
(`head`, int8). Everything else is `KVLayer`'s:

- a call's n new tokens become n x heads slots (token-major), each with its token's position;
- every query head attends over the whole row with the other heads' slots masked (`attend.Slots`'s
  `slot_head`), so the scores summed over the row's "group" (all query heads) are exactly what each
  slot's own query heads paid;
- eviction ranks the row: the lowest-priority `excess` slots go, whichever head holds them, which is
  Ada-KV's layer-wide top-k selection (a decode step adds and then evicts `heads` slots).

The price against `KVLayer`: the eager attention computes the logits for every (query head, slot) pair,
heads times the products of a uniform layer (the slots are still read once), with each KV head's mask
added inside the product (`attend.pooled_bias`); a decode step on a CPU runs h2o-kv's C++ kernel instead
(`native.pooled_attend_one`: each query head against its own head's slots only, the row read once in
slot order). A decode step's eviction takes the `heads` lowest priorities of the row in the exact order
(`lowest_in_order`: three topks, no host sync; on a CPU one C++ pass, `native.lowest_slots`) instead of one
minimum per head, and the next step writes into the slots it freed (`vacant`). Once every row frees exactly
`heads` slots a step (a full cache), decoding takes the steady path (`_decode_full`, as `KVLayer`'s): the new
token's slots are the ones freed, no count or empty-slot search is needed, and in torch's operations (a GPU's,
with the Triton attention) the step can be captured or compiled whole (`KVLayer.steady`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from h2o_kv.backends import native
from h2o_kv.cache.attend import Call, Slots
from h2o_kv.cache.layer import KVLayer
from h2o_kv.cache.routes import attend, native_lowest, steady_route
from h2o_kv.policies import SlotState

POS_SPAN = 1 << 40  # a position is below this (MAX_TOKENS), so head * POS_SPAN + pos orders by (head, pos)


def by_head(t: torch.Tensor | None, width: int, heads: int) -> torch.Tensor | None:
    """The first `width` slots of a head-pooled row [B, 1, S, ...] that hold whole tokens token-major, each token's
    heads side by side in order, as a row per head [B, heads, width / heads, ...] (a view)."""
    return None if t is None else t[:, 0, :width].unflatten(1, (width // heads, heads)).transpose(1, 2)


class PooledKVLayer(KVLayer):
    query_head: torch.Tensor | None = None  # [heads, group]: each query head's KV head, from the first query
    decode_tags: torch.Tensor | None = None  # [B, 1, heads]: a decode step's new slots' heads

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        heads = key_states.shape[1]
        if heads > 127:
            raise ValueError(f"a head-pooled layer tags slots with an int8 head: at most 127 KV heads, got {heads}")
        super().lazy_initialization(key_states[:, :1], value_states[:, :1])
        self.kv_heads = heads
        self.spare = heads  # one slot per head for the incoming token
        self.head = torch.zeros(key_states.shape[0], 1, 0, dtype=torch.int8, device=self.device)

    def _fix_budget(self, prompt_len: torch.Tensor) -> None:
        super()._fix_budget(prompt_len)
        if self.capacity is not None:  # the mean per head times the heads: the row's total
            self.capacity = self.capacity * self.kv_heads
            self.max_capacity, self.min_capacity = self.max_capacity * self.kv_heads, self.min_capacity * self.kv_heads

    def forward_attention(self, query: torch.Tensor, attention_mask, **kwargs) -> torch.Tensor:
        if self.query_head is None:
            group = query.shape[1] // self.kv_heads
            self.query_head = torch.arange(self.kv_heads, device=self.device).repeat_interleave(group).view(-1, group)
        return super().forward_attention(query, attention_mask, **kwargs)

    def _decode_full(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor, *,
                     scaling: float, softcap: float | None) -> torch.Tensor:  # fmt: skip
        """The steady decode step (`KVLayer._decode_full` for a row): the new token's `heads` slots [B, H, 1, D]
        go where the last step's eviction left `heads` empty slots in every row, each tagged with its head;
        the query heads attend over the row, and every row frees `heads` slots again (`_evict_row`); on a CPU
        with a policy ranking by score with the newest kept, all of it in one C++ call (`native.pooled_decode_step`)."""
        slots, buffered = self._take_vacant()
        batch, heads, _, dim = keys.shape
        next_pos = self.next_pos.view(-1, 1, 1)
        keys, values = keys.reshape(batch, 1, heads, dim), values.reshape(batch, 1, heads, values.shape[-1])
        backend, recent, sinks = steady_route(self, query, buffered, softcap)  # "native" or "eager": no Triton here
        if backend == "native":  # the same operations in one C++ call
            out, freed, tied = native.pooled_decode_step(
                query, self.keys, self.values, self.head, self.pos, self.score, self.last, slots, keys, values, qpos,
                recent, scaling=scaling, softcap=softcap, sinks=sinks,
            )  # fmt: skip
            if not tied:
                self._leave_vacant(freed)
                return out
        else:
            self.head.scatter_(2, slots, self._tags(batch, 1))
            self._write(slots, keys, values, qpos.view(batch, 1, 1).expand(batch, 1, heads), zeroed=True)
            out, valid = self._attend_steady(query, qpos, scaling=scaling, softcap=softcap)
            if self._evict_row(valid, self.slot_state(next_pos)):
                return out
        KVLayer._evict(self, next_pos, None, 1)  # a tie at the boundary (nothing freed): the exact (sorted) order
        return out

    def _insert(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> int | None:
        """n new tokens [B, heads, n, D] take n x heads slots; returns the first one (None while decoding)."""
        batch, heads, n, dim = keys.shape
        width = n * heads
        keys = keys.transpose(1, 2).reshape(batch, 1, width, dim)
        values = values.transpose(1, 2).reshape(batch, 1, width, values.shape[-1])
        tags = self._tags(batch, n)
        first = None
        if self.settings.mode == "drop" and n == 1:  # decoding: the slots the last step freed, or the first free ones
            slots = self._decode_slots()
            self.used = self.keys.shape[2]
        else:
            first = self.used
            self._reserve(first + width)
            slots = torch.arange(first, first + width, device=self.device).expand(batch, 1, width)
            self.used = first + width
        self.kept_bound += width
        self.head.scatter_(2, slots, tags)
        self._write(slots, keys, values, positions.repeat_interleave(heads, dim=1)[:, None])
        return first

    def _first_empty(self) -> torch.Tensor:
        return first_free(self.pos, self.spare)  # a token's `heads` slots

    def _tags(self, batch: int, n: int) -> torch.Tensor:
        """Each new slot's head, [B, 1, n x heads] token-major (a decode step's is kept)."""
        tags = self.decode_tags
        if n != 1 or tags is None or tags.shape[0] != batch:
            tags = torch.arange(self.kv_heads, dtype=torch.int8, device=self.device).repeat(n).expand(batch, 1, -1)
            if n == 1:
                self.decode_tags = tags
        return tags

    def _attend(self, query: torch.Tensor, positions: torch.Tensor, call: Call, full: bool = False):
        # `full` (every slot holds a token) changes nothing here: the row's slots are masked by head anyway
        heads = self.kv_heads
        in_pass = self.settings.reconstruction is not None and call.new_from is not None  # KVzip's held context
        if call.new_from == 0 or (in_pass and call.new_from % heads == 0):
            # the row holds this call's tokens after whole tokens before them, token-major and in order (a prompt's
            # first call; or a held call of KVzip's pass, which evicts nothing): attend per head, in order
            return self._attend_in_order(query, positions, replace(call, new_from=call.new_from // heads))
        # later calls: a token is `heads` slots, so the in-order causal shortcut (new_from) does not apply
        return super()._attend(query, positions, replace(call, new_from=None))

    def _attend_in_order(self, query: torch.Tensor, positions: torch.Tensor, call: Call):
        """A call whose row holds whole tokens in order, `call.new_from` of them before its own, as `KVLayer` attends:
        [B, heads, tokens] views of the row, the causal triangle skipped; the per-slot scores come back in the row's
        order."""
        batch, heads = query.shape[0], self.kv_heads
        width = (call.new_from + query.shape[2]) * heads
        kv = Slots(*(by_head(t, width, heads) for t in (self.keys, self.values, self.pos, self.key_scale,
                                                         self.value_scale)))  # fmt: skip
        out, scores, last = (self.settings.attention or attend)(query, kv, positions, call)

        def by_row(t: torch.Tensor | None) -> torch.Tensor | None:  # [B, heads, n] -> [B, 1, S] (empty slots: 0)
            if t is None:
                return None
            row = torch.zeros_like(self.score)
            row[:, 0, :width] = t.transpose(1, 2).reshape(batch, width)
            return row

        return out, by_row(scores), by_row(last)

    def _add_scores(self, scores: torch.Tensor, queries: int, observed: bool, new_from: int | None) -> None:
        pool = self.policy.score_pool if observed else 1
        if pool > 1:  # max over each head's own `pool` neighbouring tokens, then accumulate without pooling
            scores = self._pool_by_head(scores, pool)
            observed = False
        super()._add_scores(scores, queries, observed, new_from)

    def _pool_by_head(self, scores: torch.Tensor, pool: int) -> torch.Tensor:
        """`KVLayer`'s neighbour pooling within each head: the row sorted by (head, position), each
        slot's max over the `pool` slots around it that hold the same head."""
        width = scores.shape[-1]
        key = self.head[..., :width].to(torch.int64) * POS_SPAN + self.pos[..., :width]
        order = torch.sort(key, dim=-1, stable=True).indices
        reach = pool // 2
        ranked = torch.nn.functional.pad(scores.gather(-1, order), (reach, reach), value=0.0)
        heads = torch.nn.functional.pad(self.head[..., :width].gather(-1, order), (reach, reach), value=-1)
        around = ranked.unfold(-1, pool, 1)  # [B, 1, width, pool]
        same = heads.unfold(-1, pool, 1) == heads[..., reach : reach + width, None]
        pooled = around.masked_fill(~same, 0.0).amax(-1)  # scores are >= 0
        return torch.empty_like(scores).scatter_(-1, order, pooled)

    def _evict(self, next_pos: torch.Tensor, window: int | None, added: int) -> None:
        """A decode step frees up to `heads` slots of the row: the `heads + 1` lowest priorities (topk, not
        `KVLayer`'s two sorts) say which, unless two slots tie at the boundary (then `KVLayer`'s exact order).
        When every row frees exactly `heads` (a full cache), `_evict_row` frees them and keeps them as `vacant`."""
        if added != 1 or window is not None or self.capacity is None or self.kept_bound <= self.min_capacity:
            return super()._evict(next_pos, window, added)
        valid = self.pos >= 0
        excess = (valid.sum(-1) - self.capacity).clamp_(min=0).unsqueeze(-1)  # [B, 1, 1]
        if self.settings.mode == "drop" and bool((excess == self.spare).all()):  # a sync
            if not self._evict_row(valid, self.slot_state(next_pos)):
                super()._evict(next_pos, window, added)
            return
        state = self.slot_state(next_pos)
        priority = torch.where(valid, self.policy.priority(state), float("inf"))
        lowest = torch.topk(priority, min(self.spare + 1, priority.shape[-1]), dim=-1, largest=False)
        last_out = lowest.values.gather(-1, (excess - 1).clamp(min=0))
        first_in = lowest.values.gather(-1, excess.clamp(max=lowest.values.shape[-1] - 1))
        tie = ((last_out == first_in) | (excess >= lowest.values.shape[-1])) & (excess > 0)
        if bool(tie.any()):  # a sync
            return super()._evict(next_pos, window, added)
        self._free(valid & (priority <= last_out) & (excess > 0))
        self.kept_bound = min(self.kept_bound, self.max_capacity)

    def _evict_row(self, valid: torch.Tensor | None, state: SlotState) -> bool:
        """Every row holds exactly `heads` tokens over its capacity: free its `heads` lowest priorities (the
        next step writes there: `vacant`). `valid` None: every slot holds a token. Returns False, freeing
        nothing, when C++'s pass finds the `heads`-th and the next lowest tied (only the exact order says which
        goes); torch's operations follow the exact order (`lowest_in_order`), and keep the freed slots in the layer's
        one buffer (`_kept_slots`), as a captured step needs."""
        priority = self.policy.priority(state)
        if valid is not None:
            priority = torch.where(valid, priority, float("inf"))
        if native_lowest(self.settings, priority):
            slots, tied = native.lowest_slots(priority, self.spare)  # one pass for topk, sort and compare
            if tied:
                return False
        else:  # in torch, the exact order itself: no host sync, so a captured or compiled step can hold it
            slots = self._kept_slots(lowest_in_order(priority, self.pos, self.head, self.spare))
        for name, empty in (("pos", -1), ("score", 0.0), ("last", 0.0)):
            if getattr(self, name) is not None:
                getattr(self, name).scatter_(2, slots, empty)
        self._leave_vacant(slots, buffered=slots is self.vacant_buffer)
        return True

    def kept(self) -> torch.Tensor:
        """Tokens kept per (sequence, real KV head), [B, heads]."""
        counts = torch.zeros(self.pos.shape[0], self.kv_heads, dtype=torch.int64, device=self.device)
        return counts.scatter_add_(1, self.head[:, 0].long(), (self.pos[:, 0] >= 0).long())


def lowest_in_order(priority: torch.Tensor, pos: torch.Tensor, head: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` slots of each row [B, 1, S] in eviction order across a pooled row's heads (the lowest
    priority, then the oldest position, then the lowest head: docs/eviction.md), [B, 1, count] in slot order, with
    no host sync: every slot below the count-th lowest priority goes, and the slots at it fill the rest oldest first."""
    bound = torch.topk(priority, count, dim=-1, largest=False).values[..., -1:]
    below = priority < bound
    age = torch.where(priority == bound, pos * 128 + head.long(), torch.iinfo(torch.int64).max)  # heads < 128
    at_bound = torch.topk(age, count, dim=-1, largest=False).indices  # oldest first
    fill = torch.arange(count, device=pos.device) < count - below.sum(-1, keepdim=True)
    chosen = below | torch.zeros_like(below).scatter_(-1, at_bound, fill)
    index = torch.arange(priority.shape[-1], device=pos.device)
    return torch.topk(torch.where(chosen, index, index + priority.shape[-1]), count, dim=-1, largest=False).values


def first_free(pos: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` empty slots (pos -1) of each row of `pos` [B, 1, S], in slot order, [B, 1, count]
    (there must be that many): each empty slot's rank among the empty ones, scattered to its index."""
    empty = pos < 0
    rank = torch.where(empty, empty.cumsum(-1) - 1, count).clamp_(max=count)  # others go to a spare column
    slots = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    found = torch.zeros(*pos.shape[:2], count + 1, dtype=torch.int64, device=pos.device)
    return found.scatter_(2, rank, slots)[..., :count]

"""One attention layer's bounded store: slots per (sequence, KV head), insertion, attention, eviction.

Each layer stores keys and values in slots, [batch, kv_heads, slots, head_dim], with each slot's
absolute position (-1 = empty) and accumulated score. A forward call with n new tokens:
  1. `update` (called by the model through the cache) hands the new keys/values to the layer;
  2. the h2o-kv attention function calls `forward_attention`, which writes the new tokens into
     free slots, attends over the slots with the queries (`routes.attend`), adds the attention to
     the scores, and evicts down to the policy's capacity by freeing slots (docs/eviction.md).
In "drop" mode freed slots are reused, so once full the storage stays `capacity + 1` slots
(the extra slot takes the incoming token while decoding). In "mask" mode (the paper's accuracy
protocol) nothing is ever freed: evicted tokens stay in memory, masked per head. Sequences come and
go (select, repeat, join) through the `rows.Rows` methods.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_kv.cache.attend import compute_dtype
from h2o_kv.cache.quant import dequantize, quantize
from h2o_kv.cache.routes import Call, Slots, attend, uses_native, widens
from h2o_kv.cache.rows import GROWTH, ROW_BLOCK, Rows
from h2o_kv.cache.settings import Mode, PaddingMemo, Settings
from h2o_kv.cache.steady import Steady
from h2o_kv.policies import SlotState, short_fraction
from h2o_kv.policies.base import PromptMemo

__all__ = ["KVLayer", "Mode", "PaddingMemo", "Settings", "GROWTH"]


class KVLayer(Rows, Steady, CacheLayerMixin):
    """One attention layer's slots. Everything is per (sequence, KV head); no Python loops over them."""

    is_sliding = False
    is_croppable = False
    spare = 1  # slots one decode step adds before it evicts (the incoming token's)
    head = None  # [B, 1, S] KV head of each slot in a head-pooled layer (pooled.py); None here
    query_head = None  # [heads, group]: each query head's KV head in a head-pooled layer; None here
    # the empty slots the last decode step left, [B, H, spare]: the next step writes there. Any batch change,
    # growth or compaction of the storage forgets them (`Rows._storage_changed`)
    vacant: torch.Tensor | None = None
    vacant_buffered = False  # `vacant` is `vacant_buffer`, the memory a steady step's slots live in (`_kept_slots`)
    # every slot holds a token after each decode step's insertion (all rows at one capacity, all reached): steady
    # decode steps need no mask and no count; forgotten with `vacant` when the storage changes
    packed = False
    vacant_buffer: torch.Tensor | None = None

    def __init__(self, settings: Settings, layer_idx: int) -> None:
        super().__init__()
        self.settings = settings
        self.layer_idx = layer_idx
        self.policy = settings.policy  # this layer's own (LayerBudgets), fixed with the budget on the first call
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen = 0  # columns seen, padding included: what transformers counts positions from
        self.memo = PromptMemo()  # per-prompt values (`per_prompt`) of this `prompt_len`: emptied when it changes

    # -- transformers' layer interface ---------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return self.settings.compileable

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.kv_heads = heads
        self.dtype, self.device = key_states.dtype, key_states.device
        store = torch.int8 if self.settings.kv_dtype == "int8" else key_states.dtype
        self.keys = key_states.new_zeros(batch, heads, 0, dim, dtype=store)
        self.values = value_states.new_zeros(batch, heads, 0, value_states.shape[-1], dtype=store)
        quantized = self.settings.kv_dtype is not None
        self.key_scale = key_states.new_zeros(batch, heads, 0, dtype=torch.float32) if quantized else None
        self.value_scale = key_states.new_zeros(batch, heads, 0, dtype=torch.float32) if quantized else None
        self.pos = torch.full((batch, heads, 0), -1, dtype=torch.int64, device=self.device)
        self.score = torch.zeros(batch, heads, 0, dtype=torch.float32, device=self.device)
        self.last = torch.zeros_like(self.score) if self.settings.policy.needs_last else None
        self.next_pos = torch.zeros(batch, 1, 1, dtype=torch.int64, device=self.device)
        self.prompt_len: torch.Tensor | None = None
        self.capacity: torch.Tensor | None = None  # [B, 1] once the prompt is seen; None = unbounded
        self.max_capacity: int | None = None
        self.min_capacity: int | None = None
        self.kept_bound = 0  # upper bound on kept tokens per (sequence, head), known without a sync
        self.used = 0  # slots at or after this index are free (mask mode never reuses a slot)
        self.decoded = False  # a one-token call came after the prompt (a fraction budget is then final)
        self.grown = False  # the prompt complete, `Settings.headroom` joined the budget (`_add_headroom`)
        self.is_initialized = True
        self._rows_changed()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # KVCache.update checks that a call continues an initialised layer
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model's mask covers only the new tokens (causality and padding among them);
        # which cached tokens each head may see is the layer's business.
        if query_length == 0:
            raise ValueError(
                f"no new tokens for a KVCache that already holds {self.seen} positions: the input is not longer than "
                "what the cache has seen. A cache belongs to one model and one batch (one conversation); "
                "use a new KVCache for an unrelated prompt"
            )
        return query_length, self.seen

    def crop(self, max_length: int) -> None:
        raise ValueError(
            "h2o_kv.KVCache cannot be cropped (evicted tokens cannot come back), so assisted decoding "
            "(assistant_model=, prompt_lookup_num_tokens=) is not supported with it"
        )

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.pending = None
        self.seen = 0
        self.settings.version += 1  # emptied (`KVCache.version`)

    # -- the work: insert, attend, evict ---------------------------------------------------------------
    def forward_attention(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scaling: float,
        window: int | None = None,
        softcap: float | None = None,
        config=None,
    ) -> torch.Tensor:
        """Attention output [B, n, Hq, D] for the pending tokens; the cache is updated and evicted.
        `config` (the model's) lets a per-layer policy size this layer's budget on the first call."""
        assert self.pending is not None
        recon = self.settings.reconstruction  # KVzip's pass (reconstruct.py): a scoring call is its own
        if recon is None and self.prompt_len is None and self.settings.policy.reconstructs:
            self.pending = None
            raise ValueError(
                f"{self.settings.policy.describe()} ranks a context by reconstructing it: compress the context with "
                "h2o_kv.compress(model, input_ids, policy, tokenizer=tokenizer), then generate from that cache"
            )
        if recon is not None and (out := recon.attention(self, query, attention_mask, scaling=scaling, window=window,
                                                         softcap=softcap)) is not None:  # fmt: skip
            return out
        held = recon is not None  # the pass's context: kept whole, unscored, ranked when the pass ends
        new_keys, new_values = self.pending
        self.pending = None
        batch, n = query.shape[0], query.shape[2]
        real, has_padding = self.settings.padding.real_tokens(attention_mask, batch, n, query.device)
        real_before = real.cumsum(1) if n > 1 else real.long()  # real tokens up to and including each column
        if has_padding and bool(((real_before + self.next_pos.view(batch, 1) > 0) & ~real).any()):
            raise ValueError(
                "padding after a real token (right padding): h2o-kv needs batches padded on the left "
                "(tokenizer.padding_side = 'left') with the attention_mask"
            )
        if n == 1 and self.prompt_len is not None:
            self.decoded = True
        if self.decoded and not self.grown:
            self._add_headroom()
        if n == 1 and not has_padding:  # decoding: each row's token takes its next position
            qpos, real_before = self.next_pos.view(batch, 1).clone(), None
            first_pos = qpos.view(batch)
            self.next_pos.add_(1)  # in place: a replayed (CUDA graph) step advances the same tensor
        else:
            qpos = torch.where(real, self.next_pos.view(batch, 1) + real_before - 1, -1)
            first_pos = self.next_pos.view(batch)
            self.next_pos = self.next_pos + real.sum(1).view(batch, 1, 1)
        self.seen += n
        if self.layer_idx == 0:
            self.settings.check_context(self.seen, self.next_pos, config)
        if self.prompt_len is None:
            policy = self.settings.policy
            self.policy = policy if config is None else policy.for_layer(self.layer_idx, config)
            hint = self.settings.prompt_len
            self._fix_budget(real.sum(1) if hint is None else torch.as_tensor(hint, device=self.device).expand(batch))
        elif real_before is None and window is None and self._full():
            return self._decode_full(query, new_keys, new_values, qpos, scaling=scaling, softcap=softcap)
        policy = self.policy
        chunk = self.settings.prefill_chunk or n
        outputs = []
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            chunk_pos = qpos[:, start:stop]
            observed = policy.score_window if stop - start > 1 else None
            new_from = self._insert(new_keys[:, :, start:stop], new_values[:, :, start:stop], chunk_pos)
            score_from = 0 if observed is None else max(0, stop - start - observed)
            call = Call(scaling, window, softcap, has_padding, new_from, want_scores=policy.needs_scores and not held,
                        want_last=policy.needs_last and not held, score_from=score_from)  # fmt: skip
            out, scores, last = self._attend(query[:, :, start:stop], chunk_pos, call)
            if scores is not None:
                self._add_scores(scores, stop - start, observed=observed is not None, new_from=new_from)
            if last is not None:
                self.last = last
            if not held:
                self._evict(
                    self.next_pos if real_before is None else first_pos + real_before[:, stop - 1], window, stop - start
                )
            outputs.append(out)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _add_scores(self, scores: torch.Tensor, queries: int, observed: bool, new_from: int | None) -> None:
        """Accumulate a call's attention into the scores: decayed old scores; an observed (multi-token)
        call's scores pooled over neighbours and, if the policy says so, shared by the layer's heads."""
        policy = self.policy
        if policy.decay != 1.0:
            self.score.mul_(policy.decay**queries)
        width = scores.shape[-1]
        pool = policy.score_pool if observed else 1
        if pool > 1:  # max over `pool` neighbouring kept tokens, in position order
            order = torch.sort(self.pos[..., :width], dim=-1, stable=True).indices
            ranked = scores.gather(-1, order).flatten(0, 1).unsqueeze(1)
            pooled = torch.nn.functional.max_pool1d(ranked, pool, stride=1, padding=pool // 2)
            scores = torch.empty_like(scores).scatter_(-1, order, pooled.view_as(scores))
        if observed and policy.score_shared and new_from is not None:  # the call's tokens: one ranking per layer
            scores[..., new_from:] = scores[..., new_from:].amax(1, keepdim=True)
        (self.score if width == self.score.shape[-1] else self.score[..., :width]).add_(scores)

    def _fix_budget(self, prompt_len: torch.Tensor) -> None:
        self.prompt_len, self.memo = prompt_len.view(-1, 1, 1), PromptMemo()
        capacity = self.policy.capacity(prompt_len)
        if capacity is not None:
            self.capacity = capacity.clamp(min=1).view(-1, 1).to(self.device)
            self.max_capacity = int(self.capacity.max())
            self.min_capacity = int(self.capacity.min())
            if self.settings.sized_by_prompt and not self.settings.warned:
                short = short_fraction(self.policy.describe(), self.min_capacity, int(prompt_len.max()))
                if short is not None:  # once per cache: every layer fixes its budget
                    self.settings.warned = True
                    warnings.warn(short, stacklevel=2)

    def _add_headroom(self) -> None:
        """The prompt is complete: each (sequence, KV head) may hold `Settings.headroom` tokens past its budget, so a
        question and its answer after a compressed context join it before any of the context is evicted."""
        self.grown = True
        extra = self.settings.headroom * (self.kv_heads if self.head is not None else 1)  # a pooled row: every head's
        if extra and self.capacity is not None:
            self.capacity = self.capacity + extra
            self.max_capacity, self.min_capacity = self.max_capacity + extra, self.min_capacity + extra
            self._storage_changed()  # the steady state was sized by the old budget

    def _insert(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> int | None:
        """Write new tokens into slots; padding gets a slot but stays marked empty.

        A single token (decoding, drop mode) takes a free slot. Several tokens (a prompt or prefill
        chunk), and every token in mask mode, go in order after every used slot, which lets
        attention skip the causal upper triangle. Returns that first slot, or None.
        """
        batch, heads, n, _ = keys.shape
        if self.settings.mode == "drop" and n == 1:
            slots = self._decode_slots()
            first, self.used = None, self.keys.shape[2]  # the free slot may be anywhere
        else:
            first = self.used
            self._reserve(first + n)
            slots = slice(first, first + n)  # in order: a copy into a range of slots, not a scatter
            self.used = first + n
        self.kept_bound += n
        self._write(slots, keys, values, positions[:, None, :].expand(batch, heads, n))
        return first

    def _decode_slots(self) -> torch.Tensor:
        """Where a decode step's new token goes, [B, H, spare]: the slots the last step's eviction left
        (`vacant`), else the first empty ones once there is room."""
        slots, self.vacant = self.vacant, None
        if slots is not None:
            return slots
        needed = self.kept_bound + self.spare
        if needed > self.keys.shape[2] and self.max_capacity is not None:  # a bounded row growing toward its capacity
            # (headroom joined it after the prompt): by a block at a time up to the widest it reaches, not a copy of
            # the storage for every token
            needed = max(needed, min(self.keys.shape[2] + ROW_BLOCK, self.max_capacity + self.spare))
        self._reserve(needed)
        return self._first_empty()

    def _first_empty(self) -> torch.Tensor:
        return self.pos.argmin(-1, keepdim=True)  # the first empty slot of each row (pos -1); _reserve left one

    def _write(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        zeroed: bool = False,
    ) -> None:
        """Store tokens [B, H, n, D] at their `slots` [B, H, n] (or a `slice` of slots, the same for every row) with
        their `positions` [B, H, n] and a zero score (`zeroed`: the slots' scores are zero already, as an eviction
        leaves them)."""
        if isinstance(slots, slice):
            return self._write_range(slots, keys, values, positions)
        dim = keys.shape[-1]
        if self.key_scale is not None:  # int8 storage: quantize on the way in
            if keys.shape == values.shape:  # one quantize call for both (a decode step is kernel-bound)
                (keys, values), (key_scale, value_scale) = quantize(torch.stack((keys, values)))
            else:
                (keys, key_scale), (values, value_scale) = quantize(keys), quantize(values)
            self.key_scale.scatter_(2, slots, key_scale)
            self.value_scale.scatter_(2, slots, value_scale)
        self.keys.scatter_(2, slots[..., None].expand(-1, -1, -1, dim), keys)
        self.values.scatter_(2, slots[..., None].expand(-1, -1, -1, values.shape[-1]), values)
        self.pos.scatter_(2, slots, positions)
        if zeroed:
            return
        self.score.scatter_(2, slots, 0.0)
        if self.last is not None:
            self.last.scatter_(2, slots, 0.0)

    def _write_range(self, slots: slice, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """`_write` of a prompt or chunk into consecutive slots: copies into the range."""
        if self.key_scale is not None:
            (keys, key_scale), (values, value_scale) = quantize(keys), quantize(values)
            self.key_scale[:, :, slots] = key_scale
            self.value_scale[:, :, slots] = value_scale
        self.keys[:, :, slots] = keys
        self.values[:, :, slots] = values
        self.pos[:, :, slots] = positions
        self.score[:, :, slots] = 0.0
        if self.last is not None:
            self.last[:, :, slots] = 0.0

    def _evict(self, next_pos: torch.Tensor, window: int | None, added: int) -> None:
        """Free slots until every (sequence, head) holds at most `capacity` tokens.

        `next_pos` [B] is each sequence's next position after the tokens inserted so far; `added` is
        how many columns the last insert brought (1 while decoding: at most one eviction per head).
        """
        next_pos = next_pos.view(-1, 1, 1)
        if window is not None:  # sliding layer: tokens out of the window are never seen again
            self._free((self.pos >= 0) & (self.pos <= next_pos - window))
            self.kept_bound = int(self.occupied().max())
        if self.capacity is None or self.kept_bound <= self.min_capacity:
            shrink = window is not None and added > 1 and self.settings.mode == "drop"
            if shrink and self.keys.shape[2] > self.kept_bound + self.spare:
                self._compact(self.kept_bound + self.spare)  # the window freed more than the policy would have
            return
        valid = self.pos >= 0
        state = self.slot_state(next_pos)
        if added == 1 and self.spare == 1 and self.pos.shape[-1] > self.max_capacity:
            self._evict_one(valid, state)
            return
        excess = valid.sum(-1) - self.capacity  # [B, H]
        priority = torch.where(valid, self.policy.priority(state), float("inf"))
        if added == 1 and self.spare == 1:  # decoding: every head was within capacity, so at most one token to drop
            lowest = priority.amin(-1, keepdim=True)
            oldest = torch.where(priority == lowest, self.pos, torch.iinfo(torch.int64).max)
            victim = oldest.argmin(-1, keepdim=True)  # [B, H, 1]: the oldest of the lowest
            drop = (excess > 0).unsqueeze(-1)  # [B, H, 1]; gather/scatter of one slot beats a [B, H, S] mask
            for name, empty in (("pos", -1), ("score", 0.0), ("last", 0.0)):
                if getattr(self, name) is not None:
                    getattr(self, name).scatter_(
                        2, victim, getattr(self, name).gather(2, victim).masked_fill_(drop, empty)
                    )
            self.kept_bound = min(self.kept_bound, self.max_capacity)
            return
        # a prompt or chunk: rank by (priority, position) and drop the `excess` lowest
        evict = valid & (eviction_ranks(valid, self.pos, priority) < excess.unsqueeze(-1))
        self._free(evict)
        self.kept_bound = min(self.kept_bound, self.max_capacity)
        if self.settings.mode == "drop" and self.keys.shape[2] > self.max_capacity + self.spare:
            self._compact(self.max_capacity + self.spare)

    def slot_state(self, next_pos: torch.Tensor, keys: bool = True) -> SlotState:
        """What the policy ranks (`next_pos` [B] or [B, 1, 1]), with this layer's per-prompt memo, and the stored keys
        in float32 when the policy reads them (`keys=False`: the caller only asks `protected_recent`)."""
        stored, scale = None, self.key_scale
        if keys and self.policy.needs_keys:  # int8 storage dequantized
            stored = self.keys.float() if scale is None else dequantize(self.keys, scale, torch.float32)
        return SlotState(self.pos, self.score, self.last, next_pos.view(-1, 1, 1), self.prompt_len, self.memo, stored)

    def _free(self, mask: torch.Tensor) -> None:
        self.pos.masked_fill_(mask, -1)
        self.score.masked_fill_(mask, 0.0)
        if self.last is not None:
            self.last.masked_fill_(mask, 0.0)

    def _attend(self, query: torch.Tensor, positions: torch.Tensor, call: Call, full: bool = False):
        """`routes.attend` of a call's queries over this layer's slots (a head-pooled layer masks by head;
        `full`: every slot holds a token, nothing to mask)."""
        work = None  # decoding from int8 (or bfloat16 on a CPU): widened into the cache's buffer, not a fresh tensor
        native = uses_native(self.settings, query.device)
        if widens(query, self.keys, self.key_scale is not None, native and self.head is None):
            dtype = compute_dtype(query.dtype, query.device)
            work = self.settings.work(self.keys.numel() + self.values.numel(), dtype, query.device)
        kv = Slots(self.keys, self.values, None if full else self.pos, self.key_scale, self.value_scale, self.head,
                   self.query_head, work)  # fmt: skip
        return (self.settings.attention or attend)(query, kv, positions, call, native_kernels=native)


def eviction_ranks(valid: torch.Tensor, pos: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """Each slot's place in eviction order along the last dimension: the lowest `priority` first, ties to the oldest
    `pos`, then to the earlier slot; slots not `valid` last. Dropping the `excess` lowest is `ranks < excess`."""
    by_age = torch.sort(torch.where(valid, pos, torch.iinfo(torch.int64).max), dim=-1, stable=True).indices
    key = torch.where(valid, priority, float("inf")).gather(-1, by_age)
    order = by_age.gather(-1, torch.sort(key, dim=-1, stable=True).indices)
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)  # the inverse permutation

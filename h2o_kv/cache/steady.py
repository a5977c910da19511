"""A full layer's decode step, the hot path (mixed into `layer.KVLayer`, whose fields and general path it uses).

Once a drop-mode layer is full, each decode step adds one token per (sequence, KV head) and evicts one: the
new token goes into the slot the last step freed (`vacant`), every head attends over its slots, and frees
one again (`_evict_one`: the oldest of its lowest priorities), with none of the bookkeeping a prompt, a
chunk or a growing storage needs (`_decode_full`). On a CPU with h2o-kv's C++ kernels, and a policy whose
priority is its score with the newest tokens kept (`Policy.protected_recent`: H2O, SnapKV), the whole step
is one C++ pass per row (`native.decode_step`): the same operations in the same order, without a kernel
launch, a temporary tensor or a Python call per operation. Where the Triton kernels run (a GPU), the same
policies' step is `triton_evict.decode_evict`: the new token's write, attention, scores and each row's eviction in
three launches, over a layer whose every slot holds a token (`packed`) or whose rows have capacities of their own
(`ragged`: a served batch of prompts of different lengths). Which of the three runs is `routes.steady_route`'s choice.
`pooled.PooledKVLayer` has its own `_decode_full` for a head-pooled row and shares `_attend_steady`.
"""

from __future__ import annotations

import torch

from h2o_kv.backends import native
from h2o_kv.cache.attend import compute_dtype
from h2o_kv.cache.quant import quantize
from h2o_kv.cache.routes import Call, steady_route
from h2o_kv.cache.settings import capturing
from h2o_kv.policies import SlotState

# what a steady step reads and writes in place, at the same addresses from step to step
# what a steady step reads and writes (`head`: a head-pooled row's slot tags, pooled.py)
STEADY_FIELDS = ("keys", "values", "pos", "score", "last", "key_scale", "value_scale", "next_pos", "vacant_buffer",
                 "head")  # fmt: skip


class Steady:
    """The steady decode step of a `KVLayer` (which provides the fields, `_write`, `_attend`, `_add_scores` and
    `slot_state`)."""

    def _full(self) -> bool:
        """A drop-mode layer whose last decode step left each head one empty slot (`_evict_one`)."""
        return self.vacant is not None

    def ragged(self) -> bool:
        """Whether some row's capacity leaves slots of the storage empty for good (rows of different capacities: a
        served batch of prompts with fraction budgets), so the layer never becomes `packed`: every step masks
        the empty slots, and no host check waits for it to pack."""
        bounded = not self.packed and self.min_capacity is not None
        return bounded and self.min_capacity + self.spare < self.keys.shape[2]

    def steady(self) -> bool:
        """Whether this layer's next decode step is the fixed-shape one a CUDA graph or a compiled step can replay:
        a drop-mode row per KV head (or a head-pooled row, pooled.py), prompt seen, no call in flight, every slot
        full (`packed`) or rows of different capacities (`ragged`), the slots left by the last step (`vacant`), and
        scores that do not decay."""
        return (
            self.is_initialized
            and self.settings.mode == "drop"
            and self.pending is None
            and self.prompt_len is not None
            and self._full()
            and (self.packed or self.ragged())
            and self.policy.decay == 1.0
        )

    def steady_key(self) -> tuple:
        """What a captured steady step of this layer was recorded against: which route it takes (`packed`,
        `ragged`, `vacant_buffered`) and the addresses of every tensor it reads or writes (the storage, the row
        budgets, the vacant slots, the per-prompt values, the widening buffer). Equal keys: a replay reads and writes
        what an eager step would. A row written into or freed in place changes none of them (rows.py); a C++ step
        (a CPU's) leaves its freed slots in a new tensor each time, so its layer's key changes every step."""
        tensors = [getattr(self, name) for name in (*STEADY_FIELDS, "capacity", "prompt_len")]
        for value in self.memo.values():  # a tensor, or a tuple of them
            tensors += [t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor)]
        tensors += [getattr(self.settings, "_work", None), self.vacant]  # `vacant`: the buffer, but after a C++ step
        addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
        return self.packed, self.ragged(), self.vacant_buffered, tuple(self.memo), addresses

    def _decode_full(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor, *,
                     scaling: float, softcap: float | None) -> torch.Tensor:  # fmt: skip
        """The steady decode step, the hot path: the general path's operations in order, without the
        bookkeeping a prompt, a chunk or a growing storage needs. The new token [B, H, 1, D] at positions
        `qpos` [B, 1] takes the slot the last eviction left (its score is already zero), every head attends
        over its slots and then frees one again."""
        slots, buffered = self._take_vacant()
        batch, heads = slots.shape[:2]
        backend, recent, sinks = steady_route(self, query, buffered, softcap)
        if backend == "native":  # the same operations in one C++ pass per (sequence, KV head)
            return self._decode_fused(query, keys, values, qpos, slots, recent, sinks, scaling=scaling,
                                      softcap=softcap)  # fmt: skip
        if backend == "triton":  # write, attend, score and evict in three Triton launches
            return self._decode_triton(query, recent, sinks, keys, values, qpos, scaling=scaling)
        self._write(slots, keys, values, qpos.view(batch, 1, 1).expand(batch, heads, 1), zeroed=True)
        out, valid = self._attend_steady(query, qpos, scaling=scaling, softcap=softcap)
        self._evict_one(valid, self.slot_state(self.next_pos))
        return out

    def _decode_fused(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor,
                      slots: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor | None, *, scaling: float,
                      softcap: float | None):  # fmt: skip
        """`_decode_full` as one `native.decode_step`: write, attend, score and evict in one pass per row."""
        scales = None
        if self.key_scale is not None:  # int8 storage: quantize on the way in, as `_write` does
            (keys, values), scales = quantize(torch.stack((keys, values)))
        out, freed = native.decode_step(
            query,
            self.keys,
            self.values,
            self.pos,
            self.score,
            self.last,
            slots,
            keys,
            values,
            qpos,
            recent,
            self.capacity,
            scaling=scaling,
            softcap=softcap,
            key_scale=self.key_scale,
            value_scale=self.value_scale,
            new_scales=scales,
            sinks=sinks,
        )
        self.end_steady(freed)
        return out.to(query.dtype)

    def _decode_triton(self, query: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor | None,
                       keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor, *, scaling: float):  # fmt: skip
        """Write the new token (keys, values [B, H, 1, D] at positions qpos [B, 1]) into the vacant buffer's slots,
        attend, add the scores and free each row's victim there (`triton_evict.decode_evict`). int8 storage gets
        the token quantized as `_write` quantizes it; a `ragged` layer's rows each keep their own capacity."""
        from h2o_kv.backends import triton_evict

        scales = {}
        if self.key_scale is not None:
            if keys.shape == values.shape:  # as `_write`: one quantize call for both
                (keys, values), (key_scale, value_scale) = quantize(torch.stack((keys, values)))
            else:
                (keys, key_scale), (values, value_scale) = quantize(keys), quantize(values)
            scales = dict(new_key_scale=key_scale, new_value_scale=value_scale)
        q = query.to(compute_dtype(query.dtype, query.device))
        out = triton_evict.decode_evict(q, self.keys, self.values, self.pos, self.score, self.vacant_buffer,
                                        self.next_pos, recent, scaling=scaling, key_scale=self.key_scale,
                                        value_scale=self.value_scale, new_key=keys, new_value=values,
                                        new_pos=qpos, **scales, sinks=sinks,
                                        capacity=None if self.packed else self.capacity)  # fmt: skip
        self._leave_vacant(self.vacant_buffer, buffered=True)
        return out.to(query.dtype)

    def _take_vacant(self) -> tuple[torch.Tensor, bool]:
        """The slots [B, H, spare] the last step's eviction left, where a steady step writes its new token, and
        whether they are the layer's `vacant_buffer`."""
        slots, self.vacant = self.vacant, None
        self.kept_bound += slots.shape[-1]
        return slots, self.vacant_buffered

    def _leave_vacant(self, slots: torch.Tensor, *, buffered: bool = False) -> None:
        """A decode step freed `slots` [B, H, spare] (one token per head, or a row's `heads`): the next step writes
        there; every head is back within its capacity."""
        self.vacant, self.vacant_buffered = slots, buffered
        self.kept_bound = min(self.kept_bound, self.max_capacity)

    def end_steady(self, freed: torch.Tensor) -> None:
        """After the C++ pass: the slots it freed are where the next step writes."""
        self._leave_vacant(freed)

    def _attend_steady(self, query: torch.Tensor, qpos: torch.Tensor, *, scaling: float, softcap: float | None):
        """A steady decode step's attention with its scores added (`_decode_full`, here and pooled.py's); returns
        the output and which slots hold a token, None once every one does (`packed`: every row's capacity fills the
        storage, all reached; each step then evicts what it adds, so it stays so)."""
        policy, packed = self.policy, self.packed
        call = Call(scaling, softcap=softcap, want_scores=policy.needs_scores, want_last=policy.needs_last)
        out, scores, last = self._attend(query, qpos, call, full=packed)
        if scores is not None:
            self._add_scores(scores, 1, observed=False, new_from=None)
        if last is not None:
            self.last.copy_(last)  # in place: a replayed step reads the same buffer
        valid = None if packed else self.pos >= 0
        can_pack = not packed and not self.ragged() and not capturing()
        if can_pack and bool(valid.all()):  # a host sync, until packed (never inside a captured or compiled step)
            self.packed = True
        return out, valid

    def _evict_one(self, valid: torch.Tensor | None, state: SlotState) -> None:
        """A decode step's eviction once the storage has more slots than any capacity: each head over its
        capacity frees the oldest of its lowest priorities, and each head within it has an empty slot,
        which it "frees" instead (its empty slots rank lowest). So each field is freed with one scatter,
        without asking which heads evict, and every head ends with the slot the next step writes to (`vacant`)."""
        priority = self.policy.priority(state)
        if valid is not None:  # `valid` None: every slot holds a token and every head is over its capacity
            over = valid.sum(-1, keepdim=True) > self.capacity.view(-1, 1, 1)  # [B, H, 1]
            priority = torch.where(valid, priority, torch.where(over, float("inf"), float("-inf")))
        lowest = priority.amin(-1, keepdim=True)
        oldest = torch.where(priority == lowest, self.pos, torch.iinfo(torch.int64).max)
        victim = oldest.argmin(-1, keepdim=True)  # [B, H, 1]: the oldest of the lowest (an empty slot: pos -1)
        for name, empty in (("pos", -1), ("score", 0.0), ("last", 0.0)):
            if getattr(self, name) is not None:
                getattr(self, name).scatter_(2, victim, empty)
        if self.settings.mode == "drop":
            self._leave_vacant(self._kept_slots(victim), buffered=True)
        self.kept_bound = min(self.kept_bound, self.max_capacity)

    def _kept_slots(self, victim: torch.Tensor) -> torch.Tensor:
        """`victim` copied into the layer's one buffer of vacant slots, so that every steady step reads and writes
        the same memory (what a replayed CUDA graph of the step needs); a new buffer when the shape changed."""
        held = self.vacant_buffer
        if held is None or held.shape != victim.shape or held.device != victim.device:
            self.vacant_buffer = victim.clone()
            if not capturing():  # the storage is final: torch.compile's CUDA graphs may keep its addresses
                for name in STEADY_FIELDS:
                    if getattr(self, name) is not None:
                        torch._dynamo.mark_static_address(getattr(self, name))
            return self.vacant_buffer
        return held.copy_(victim)

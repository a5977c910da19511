"""A layer's storage: its sequences (rows along the batch dimension: select, repeat, reorder and join
them) and its slots (grow to a size, compact the kept ones to the front).

transformers calls the first three (beam search, `num_return_sequences`); the engine's continuous
batching calls `select_rows` when sequences finish and `append_rows` when new ones join, or, keeping every row in
place (a batch bucket's rows, preallocated), `reserve_rows`, `write_row` into a free row and `clear_rows`. Mixed into
`layer.KVLayer`, whose per-slot fields (`SLOT_FIELDS`, [B, H, S, ...]) and per-sequence fields
(`ROW_FIELDS`, [B, ...]) move together, row by row.
"""

from __future__ import annotations

import copy

import torch

from h2o_kv.policies.base import PromptMemo

SLOT_FIELDS = ("keys", "values", "pos", "score", "last", "key_scale", "value_scale", "head")  # [B, H, S, ...], or None
ROW_FIELDS = ("next_pos", "prompt_len", "capacity")  # per-sequence tensors, [B, ...]
# a free row's: no position yet, a one-token prompt, the least capacity (one slot per KV head: times `spare`)
FREE_ROW = {"next_pos": 0, "prompt_len": 1, "capacity": 1}
GROWTH = 256  # slots added at a time to an unbounded (Full) cache
# a storage whose rows are kept in place grows to a multiple of this many slots (`write_row`): a longer prompt
# joining seldom grows it again (each growth copies every row, and a captured step is recorded again)
ROW_BLOCK = 64


class Rows:
    """The storage operations of a `KVLayer` (which provides the fields), and what the storage holds."""

    # -- what the storage holds -----------------------------------------------------------------------
    def kept(self) -> torch.Tensor:
        """Tokens kept per (sequence, KV head), [B, H]."""
        return self.occupied()

    def occupied(self) -> torch.Tensor:
        """Used slots per row of the storage, [B, H] (a head-pooled layer has one row per sequence)."""
        return (self.pos >= 0).sum(-1)

    def nbytes(self) -> int:
        """Bytes allocated: every slot of the storage, empty or not, and its bookkeeping."""
        tensors = (self.keys, self.values, self.pos, self.score, self.last, self.key_scale, self.value_scale, self.head)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def kept_nbytes(self, row: int | None = None) -> int:
        """Bytes of the slots that hold a token (with their bookkeeping), of one sequence `row` or all: what the
        kept tokens need (a host sync)."""
        slots = self.pos.numel()
        kept = (self.pos if row is None else self.pos[row]) >= 0
        return self.nbytes() * int(kept.sum()) // slots if slots else 0

    # -- sequences: select, repeat, reorder, join --------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in SLOT_FIELDS + ROW_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))
        self._rows_changed()

    def forked(self, rows: torch.Tensor, settings) -> Rows:
        """A copy of this layer holding only `rows` (copies of their slots, positions, scores and budgets), with the
        cache's `settings` of the copy; this layer is unchanged."""
        twin = copy.copy(self)
        twin.settings = settings
        twin.vacant_buffer = twin.decode_tags = None  # the steady step's buffers are per layer: made again
        twin.batch_select_indices(rows)
        twin._refresh_bounds()
        return twin

    def _rows_changed(self) -> None:
        """Rows came or went: the per-prompt memo and the storage's steady-step state belong to the old rows."""
        self.memo = PromptMemo()
        self._storage_changed()

    def _storage_changed(self) -> None:
        """The slot tensors were replaced (rows, growth, compaction): the slots the last decode step left
        (`vacant`) and the packed state describe the old storage, and the next step finds its slots again."""
        self.vacant, self.vacant_buffered, self.packed = None, False, False
        self.settings.version += 1

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep these sequences only; storage shrinks to the most tokens a kept row holds (+1 in drop mode)."""
        if not self.is_initialized:
            return
        self.batch_select_indices(rows)
        self._refresh_bounds()
        if self.settings.mode == "drop":
            self._compact(self.kept_bound + self.spare if self.pos.shape[0] else 0)

    def append_rows(self, other: Rows) -> None:
        """Add the sequences of another layer (same model and policy) after this layer's rows."""
        if not other.is_initialized or other.prompt_len is None:
            raise ValueError("only sequences whose prompt has been through the cache can join a batch")
        if not self.is_initialized:
            copied = ("dtype", "device", "policy", "used", "seen", "kept_bound", "decoded", "kv_heads", "spare")
            for name in (*copied, *SLOT_FIELDS, *ROW_FIELDS):
                setattr(self, name, getattr(other, name))
            self.is_initialized = True
            self._rows_changed()
            self._refresh_bounds()
            return
        self._check_joins(other)
        width = max(self.keys.shape[2], other.keys.shape[2])
        for name in SLOT_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None:
                continue
            setattr(self, name, stacked(mine, theirs, width, -1 if name == "pos" else 0))
        for name in ROW_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None:
                setattr(self, name, torch.cat([mine, theirs]))
        self.used = width
        self.seen = max(self.seen, other.seen)
        self.kept_bound = max(self.kept_bound, other.kept_bound)
        self._rows_changed()
        self._refresh_bounds()

    # -- rows in place: a batch bucket's rows, each joined and freed without moving the others ------------------
    def reserve_rows(self, rows: int) -> None:
        """Hold `rows` sequences, those past the current ones free (as `clear_rows` leaves a row): a copy of the
        storage, once per growth (the engine grows a batch by buckets, so a join rarely needs one)."""
        extra = rows - self.pos.shape[0]
        if extra <= 0:
            return
        for name in SLOT_FIELDS + ROW_FIELDS:
            t = getattr(self, name)
            if t is not None:
                fill = self._free_value(name) if name in ROW_FIELDS else -1 if name == "pos" else 0
                setattr(self, name, torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)]))
        self._rows_changed()
        self._refresh_bounds()

    def reserve_width(self, slots: int) -> None:
        """Grow a bounded layer's storage to at least `slots` slots per row, rounded up to a multiple of `ROW_BLOCK`
        (the width a join in place grows it to, `joined_width`), so that rows joining later need no growth. A
        head-pooled layer's (pooled.py) row is not counted in these slots: left as it is."""
        if self.max_capacity is not None and self.head is None and slots > self.keys.shape[2]:
            self._reserve(-(-slots // ROW_BLOCK) * ROW_BLOCK)

    def write_row(self, row: int, other: Rows) -> None:
        """Write the one sequence of `other` (its prompt seen) into the free row `row`, in place: its slots, positions,
        scores and budget. No other row moves, unless the storage has fewer slots than the new row can fill (its
        capacity and spare): then every row grows to that, rounded up to a multiple of `ROW_BLOCK`. A steady layer
        that did not grow stays steady (as `clear_rows` leaves it): the other rows keep the slots their last step
        freed, and the new row's next token goes into its first empty slots, where the general path would put it;
        so the step after a join is a replay too, not an eager step of the whole batch."""
        self._check_joins(other)
        if other.pos.shape[0] != 1:
            raise ValueError(f"a free row takes one sequence, got {other.pos.shape[0]}")
        width = other.keys.shape[2]
        self._reserve(self.joined_width(other, in_place=True))
        for name in SLOT_FIELDS:
            mine = getattr(self, name)
            if mine is not None:
                mine[row, :, :width] = getattr(other, name)[0]
                if name in ("pos", "score", "last", "head"):
                    mine[row, :, width:] = -1 if name == "pos" else 0
        for name in ROW_FIELDS:
            getattr(self, name)[row] = getattr(other, name)[0]
        self.seen = max(self.seen, other.seen)
        self.used = self.keys.shape[2]
        if self.vacant is None or self.head is not None:  # grown, or not steady: the next step finds its slots
            self._storage_changed()
        else:  # a layer of one slot per head a step (`spare` 1): the general path's `_first_empty`
            self.vacant[row] = self._first_empty()[row]
            self.packed = False
        self._refresh_memo()
        self._refresh_bounds()

    def joined_width(self, other: Rows, *, in_place: bool) -> int:
        """The slots per row this layer's storage has once `other`'s one sequence has joined and decodes: at least
        what that row can fill (its slots, or its capacity and spare); in place (`write_row`) grown only when too
        narrow, rounded up to a multiple of `ROW_BLOCK`, else (`append_rows`) the wider of the two."""
        needed = max(other.keys.shape[2], other.kept_bound + other.spare, (other.max_capacity or 0) + other.spare)
        have = self.keys.shape[2]
        if not in_place or needed <= have:
            return max(have, needed)
        return -(-needed // ROW_BLOCK) * ROW_BLOCK

    def clear_rows(self, rows: list[int]) -> None:
        """Free these rows in place (their sequences left): no slot holds a token, and a free row's budget (the
        least: a step fed into it keeps one token per head). No other row moves; a steady layer stays steady, each
        free row's next token going into its first slot."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.pos.device)
        self.pos.index_fill_(0, index, -1)
        for name in ("score", "last", *ROW_FIELDS):
            t = getattr(self, name)
            if t is not None:
                t.index_fill_(0, index, self._free_value(name) if name in ROW_FIELDS else 0)
        self._refresh_memo()
        if self.vacant is None or self.head is not None:  # a head-pooled row's new slots: found again next step
            self._storage_changed()
        else:
            self.vacant.index_fill_(0, index, 0)
            self.packed = False
        self._refresh_bounds()

    def _refresh_memo(self) -> None:
        """The per-prompt values of the new prompt lengths, in the tensors that held the old ones where they can
        (`PromptMemo.refresh`): a captured decode step reads them there."""
        self.settings.version += 1
        if isinstance(self.memo, PromptMemo):
            self.memo.refresh(self.prompt_len)
        else:
            self.memo = PromptMemo()

    def _free_value(self, name: str) -> int:
        return FREE_ROW[name] * (self.spare if name == "capacity" else 1)

    def _check_joins(self, other: Rows) -> None:
        if not other.is_initialized or other.prompt_len is None:
            raise ValueError("only sequences whose prompt has been through the cache can join a batch")
        if self.keys.shape[1:2] + self.keys.shape[3:] != other.keys.shape[1:2] + other.keys.shape[3:]:
            raise ValueError(
                f"cannot join sequences of another model: KV heads x head size {tuple(other.keys.shape[1::2])} "
                f"vs {tuple(self.keys.shape[1::2])}"
            )
        if (self.capacity is None) != (other.capacity is None):
            raise ValueError("cannot join a bounded sequence with an unbounded one")

    def _refresh_bounds(self) -> None:
        """Python-side bounds from the per-row tensors (after rows came or went)."""
        self.settings.version += 1
        empty = self.pos.shape[0] == 0
        if self.capacity is not None and not empty:
            self.max_capacity, self.min_capacity = int(self.capacity.max()), int(self.capacity.min())
        self.kept_bound = 0 if empty else int(self.occupied().max())

    def _reserve(self, needed: int) -> None:
        """Grow the slot storage to at least `needed` slots (in blocks when unbounded)."""
        have = self.keys.shape[2]
        if needed <= have:
            return
        if self.max_capacity is None:
            needed = -(-needed // GROWTH) * GROWTH
        for name in SLOT_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, grow(getattr(self, name), needed - have, -1 if name == "pos" else 0))
        self._storage_changed()

    def _compact(self, slots: int) -> None:
        """Move kept tokens to the front and shrink storage to `slots` (after a prefill chunk)."""
        order = torch.sort((self.pos < 0).to(torch.uint8), dim=-1, stable=True).indices[..., :slots]
        for name in SLOT_FIELDS:
            t = getattr(self, name)
            if t is not None:  # [B, H, S] fields, and [B, H, S, D] keys and values
                index = order if t.dim() == 3 else order[..., None].expand(-1, -1, -1, t.shape[-1])
                setattr(self, name, t.gather(2, index))
        self._storage_changed()
        self.used = min(self.kept_bound, slots)


def stacked(first: torch.Tensor, second: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """`first` [B1, H, S1, ...] and `second` [B2, H, S2, ...] as rows of one tensor [B1 + B2, H, width, ...], the
    slots past each one's own filled with `fill`: each copied once (growing both, then concatenating, copied the
    rows up to three times). Under autograd (a prefill outside `torch.no_grad`) they are grown and concatenated,
    which autograd records."""
    if first.requires_grad or second.requires_grad:
        return torch.cat([grow(first, width - first.shape[2], fill), grow(second, width - second.shape[2], fill)])
    out = first.new_empty((first.shape[0] + second.shape[0], first.shape[1], width, *first.shape[3:]))
    for rows, t in ((out[: first.shape[0]], first), (out[first.shape[0] :], second)):
        rows[:, :, : t.shape[2]] = t
        rows[:, :, t.shape[2] :] = fill
    return out


def grow(t: torch.Tensor, extra: int, fill: float) -> torch.Tensor:
    """`t` [B, H, S, ...] with `extra` more slots at the end, filled with `fill`."""
    pad = t.new_full((*t.shape[:2], extra, *t.shape[3:]), fill)
    return torch.cat([t, pad], dim=2)

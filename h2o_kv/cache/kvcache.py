"""The cache a model is given: a transformers `Cache` of `KVLayer`s sharing one policy.

`KVCache` is what users pass as `past_key_values`. Its `update` hands each layer's new keys to
the h2o-kv attention call that follows (see attention.py); the layers do the work (layer.py).

What a serving runtime may use, and all it may use (it reads no layer's fields): sequences in and out of a
running batch (`write_rows`, `free_rows`; rows kept in place: `reserve_rows`, `release_rows`), a copy of some
sequences (`fork`), whether the next decode step has fixed shapes (`steady`) and the bookkeeping of a replayed
one (`note_replayed_step`), and what a sequence holds (`row_stats`, `nbytes`, `kept_per_head`, `kept_map`).
KVzip's context-reconstruction pass is `reconstruction()` (reconstruct.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

from h2o_kv.backends import native
from h2o_kv.cache.attention import hand_off, take_forward_mark
from h2o_kv.cache.formats import check_kv_dtype
from h2o_kv.cache.kept import KeptMap, kept_map
from h2o_kv.cache.layer import KVLayer, Mode, Settings
from h2o_kv.cache.pooled import PooledKVLayer
from h2o_kv.cache.reconstruct import Reconstruction
from h2o_kv.cache.settings import capturing
from h2o_kv.policies import MAX_TOKENS, Policy

__all__ = ["KVCache", "KVLayer", "Mode"]


def check_headroom(headroom: int) -> None:
    """Refuse a `headroom` that is not a count of tokens (`KVCache`'s, the engine's)."""
    if isinstance(headroom, bool) or not isinstance(headroom, int) or not 0 <= headroom <= MAX_TOKENS:
        raise ValueError(f"headroom must be an int of tokens in [0, {MAX_TOKENS}], got {headroom!r}")


class KVCache(Cache):
    """A bounded KV cache for transformers models, evicting with `policy` (H2O, Local, ...).

    Use it as `past_key_values` in `model(...)` or `model.generate(...)` after `h2o_kv.enable(model)`.
    `mode="drop"` frees evicted tokens' memory; `mode="mask"` keeps them masked (the paper's
    accuracy simulation; same outputs, full memory). `prefill_chunk` processes long inputs in
    chunks with eviction between them, bounding the cache by capacity + chunk. `prompt_len` sizes
    fractional budgets from that many prompt tokens, for a prompt fed in several calls.
    `kv_dtype="int8"` stores the kept keys and values as int8 with per-token scales (about 4x fewer
    bytes than float32; see quant.py). Decode steps on a CPU over float32, bfloat16 or int8 storage or a head-pooled
    layer (AdaKV) run h2o-kv's C++ kernels, built once per machine where ninja and a C++ compiler are found
    (native.py); `compile_kernel=False` keeps the eager path, `compile_kernel=True` requires the kernels (an
    error where they cannot be built). `headroom`: tokens each (sequence, KV head) may hold past its budget once
    the prompt is complete (a one-token call came, or `end_prompt()`): a question and its answer after a compressed
    context join it without evicting any of it, as kvpress appends them to its compressed cache; 0 by default.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        mode: Mode = "drop",
        prefill_chunk: int | None = None,
        prompt_len: int | None = None,
        kv_dtype: str | None = None,
        compile_kernel: bool | None = None,
        headroom: int = 0,
    ) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an h2o_kv policy (H2O, Local, ...), got {type(policy).__name__}")
        if mode not in ("drop", "mask"):
            raise ValueError(f"mode must be 'drop' or 'mask', got {mode!r}")
        for name, value in (("prefill_chunk", prefill_chunk), ("prompt_len", prompt_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
            if value is not None and not 0 < value <= MAX_TOKENS:
                raise ValueError(f"{name} must be a positive int (at most {MAX_TOKENS}), got {value!r}")
        check_headroom(headroom)
        check_kv_dtype(kv_dtype)
        kernels = native.resolve(compile_kernel)
        self.settings = Settings(policy, mode, prefill_chunk, prompt_len, kv_dtype=kv_dtype, compile_kernel=kernels,
                                 headroom=headroom)  # fmt: skip
        super().__init__(layer_class_to_replicate=self._new_layer)
        self._allocated = (-1, 0)  # `nbytes` at a `version`

    @property
    def is_compileable(self) -> bool:
        """Whether transformers' `generate` may compile the decode step, as it does StaticCache's (`Settings`)."""
        return self.settings.compileable

    @property
    def layer_class_to_replicate(self) -> Callable[[], KVLayer]:
        """What transformers' `Cache.update` calls to add a layer: `_new_layer`, bound on each read. Stored, the bound
        method would make every cache a reference cycle, freed only when Python's cyclic collector next runs (its
        rare full pass: a long-running process held its caches' keys and values for hours), not when it is let go."""
        return self._new_layer

    @layer_class_to_replicate.setter
    def layer_class_to_replicate(self, value: Any) -> None:  # `Cache.__init__` assigns it: the property answers
        pass

    policy = property(lambda self: self.settings.policy)
    mode = property(lambda self: self.settings.mode)
    prefill_chunk = property(lambda self: self.settings.prefill_chunk)

    def _new_layer(self) -> KVLayer:
        layer = PooledKVLayer if self.settings.policy.head_pooled else KVLayer
        return layer(self.settings, len(self.layers))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.settings.version += 1  # an eager call: what a layer holds on the host may change (`version`)
        previous = hand_off(None, key_states)
        stale = previous is not None and previous[0] in self.layers and previous[0].pending is not None
        if stale:
            previous[0].pending = None  # the last layer's keys never reached h2o-kv attention
        batch, _, n, _ = key_states.shape
        # A compiled or captured step trusts the eager calls before it (transformers' generate hands a compiled step
        # a mask it built outside, so no mark is made inside).
        traced = capturing() and len(self.layers) > 0 and self.layers[0].is_initialized
        if stale or (layer_idx == 0 and not traced and take_forward_mark() not in ((batch, n), (1, n))):
            raise RuntimeError(
                "h2o_kv.KVCache needs the model's attention to go through h2o-kv to see attention scores: "
                "call h2o_kv.enable(model) first (this attention implementation does not give scores)"
            )
        self._check_layers(layer_idx, n)
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            check_continues(self.layers[layer_idx], key_states, value_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        hand_off(self.layers[layer_idx], keys)
        return keys, values

    def _check_layers(self, layer_idx: int, n: int) -> None:
        """Every call must reach the same layers: a cache filled by one model cannot serve another. Not checked
        inside a torch.compile trace: there the comparison of two layers' counts becomes a symbolic equality that
        inductor's generated code mishandles (an unbound symbol at Llama-3-8B's 32 layers)."""
        layers = self.layers
        first = layer_idx == 0 and layers and layers[0].is_initialized and not torch.compiler.is_compiling()
        if first and layers[-1].seen != layers[0].seen:
            raise ValueError(
                f"the last call reached {sum(layer.seen == layers[0].seen for layer in layers)} of this KVCache's "
                f"{len(layers)} layers: a cache belongs to one model and one batch; use a new KVCache"
            )
        if layer_idx >= len(layers) and layers and layers[-1].seen != n:
            raise ValueError(
                f"this KVCache was filled by a model with {len(layers)} layers and now gets layer {layer_idx}: "
                "a cache belongs to one model and one batch; use a new KVCache"
            )

    # -- sequences in and out of a running batch (continuous batching) --------------------------------
    @property
    def batch_size(self) -> int:
        layer = self.layers[0] if self.layers else None
        return layer.keys.shape[0] if layer is not None and layer.is_initialized else 0

    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these sequences (in this order) and shrink the storage to what they hold."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        for layer in self.layers:
            layer.select_rows(rows)

    def free_rows(self, rows: list[int]) -> None:
        """Let these sequences go: the others keep their order (row i of those left is the i-th survivor)."""
        gone = set(rows)
        self.select_rows([row for row in range(self.batch_size) if row not in gone])

    def write_rows(self, other: KVCache, into: int | None = None) -> range:
        """Take in the sequences of `other` (same policy and mode, same model, prompt seen) after this cache's;
        returns the rows they now hold. `other` is spent: its storage now belongs to this cache. `into`: the
        free row (`reserve_rows`, `release_rows`) that `other`'s one sequence is written into, in place: no other
        row's storage moves (unless the storage is narrower than the new row's capacity: then it grows once)."""
        if into is None:
            first = self.batch_size
            self.append_rows(other)
            return range(first, self.batch_size)
        self._check_joins(other)
        for mine, theirs in zip(self.layers, other.layers):
            mine.write_row(into, theirs)
        return range(into, into + 1)

    def reserve_rows(self, rows: int) -> None:
        """Hold `rows` sequences, the new rows free (`write_rows(other, into=row)` fills one): a copy of the storage
        when it grows. Only for a drop-mode cache with a bounded policy (`rows_in_place`)."""
        if not self.rows_in_place:
            raise ValueError(f"free rows need a drop-mode cache with a bounded policy, not {self.policy.describe()}")
        for layer in self.layers:
            layer.reserve_rows(rows)

    def reserve_width(self, slots: int) -> None:
        """Each layer's storage at least `slots` slots per row and KV head (in blocks: `Rows.reserve_width`): the
        engine reserves the widest row its batch will hold (`SlotCount.slots`), so that a wider row joining later
        does not copy the storage (and on a GPU, record its step again). Not for layers sized apart (`layers_alike`)."""
        if not self.rows_in_place:
            raise ValueError(f"free rows need a drop-mode cache with a bounded policy, not {self.policy.describe()}")
        if self.layers_alike():
            for layer in self.layers:
                layer.reserve_width(slots)

    def release_rows(self, rows: list[int]) -> None:
        """Let these sequences go and keep their rows, free, in place: every other row keeps its row and storage
        (`free_rows` instead packs the survivors). A free row's decode step keeps at most one token per KV head."""
        for layer in self.layers:
            layer.clear_rows(rows)

    @property
    def rows_in_place(self) -> bool:
        """Whether rows can be kept free in place (`reserve_rows`, `release_rows`): a drop-mode cache with a bounded
        policy (a free row then holds at most one token per KV head, whatever it is fed)."""
        return self.mode == "drop" and self.policy.capacity(torch.ones(1, dtype=torch.long)) is not None

    def append_rows(self, other: KVCache) -> None:
        """Move the sequences of `other` (same policy and mode, same model, prompt seen) after this cache's."""
        self._check_joins(other)
        for mine, theirs in zip(self.layers, other.layers):
            mine.append_rows(theirs)

    def _check_joins(self, other: KVCache) -> None:
        if (other.policy, other.mode, other.settings.kv_dtype) != (self.policy, self.mode, self.settings.kv_dtype):
            raise ValueError(
                f"can only join caches with the same policy, mode and kv_dtype: {self.policy.describe()} ({self.mode}, "
                f"{self.settings.kv_dtype}) vs {other.policy.describe()} ({other.mode}, {other.settings.kv_dtype})"
            )
        if len(other.layers) != len(self.layers):
            raise ValueError(f"cannot join a cache of {len(other.layers)} layers to one of {len(self.layers)}")

    def fork(self, rows: list[int] | None = None) -> KVCache:
        """A new cache holding copies of these sequences (all by default): their kept slots, positions, scores and
        budgets, so each copy goes on as the original would. The original is unchanged, and the two share no
        storage. Refused while a forward call is in flight (a layer holds keys not yet attended)."""
        if not self.layers or not all(layer.is_initialized for layer in self.layers):
            raise ValueError("fork needs a cache that has seen its prompt: this one holds nothing yet")
        if any(layer.pending is not None for layer in self.layers):
            raise ValueError("cannot fork a cache in the middle of a forward call")
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        if not rows or not all(0 <= row < self.batch_size for row in rows):
            raise ValueError(f"fork takes rows in [0, {self.batch_size}), got {rows}")
        mine = self.settings
        twin = KVCache(mine.policy, mode=mine.mode, prefill_chunk=mine.prefill_chunk, prompt_len=mine.prompt_len,
                       kv_dtype=mine.kv_dtype, compile_kernel=mine.compile_kernel, headroom=mine.headroom)  # fmt: skip
        twin.settings.warned, twin.settings.past_context = mine.warned, mine.past_context  # warned once, as one cache
        index = torch.as_tensor(rows, dtype=torch.long)
        twin.layers = [layer.forked(index, twin.settings) for layer in self.layers]
        return twin

    def end_prompt(self) -> None:
        """The prompt is complete: a fraction budget keeps what it gave, a later multi-token call (a question after a
        compressed context) continues the sequence instead of being refused as the prompt's second part, and the
        `headroom` joins each row's capacity now (so rows joining a batch bring their own)."""
        self.settings.version += 1
        for layer in self.layers:
            if layer.is_initialized and layer.prompt_len is not None:
                layer.decoded = True
                if not layer.grown:
                    layer._add_headroom()

    def reconstruction(self) -> Reconstruction:
        """KVzip's context-reconstruction pass over this empty cache, a context manager (cache/reconstruct.py;
        `h2o_kv.compress` drives it): calls inside hold the context whole, calls inside its `scoring()` score it and
        are dropped, and leaving it keeps each (sequence, KV head)'s capacity of best-scored tokens."""
        self.settings.version += 1
        return Reconstruction(self.settings, self.layers)

    # -- the steady decode step (runtime/graphs.py) ------------------------------------------------------
    @property
    def steady(self) -> bool:
        """Whether the next decode step has fixed shapes and touches the same memory as the one after it, so
        that it can be captured as a CUDA graph or compiled once (`KVLayer.steady`)."""
        return bool(self.layers) and all(layer.steady() for layer in self.layers)

    def steady_key(self) -> tuple | None:
        """None unless `steady`; then what a captured step depends on (each layer's `steady_key`: its route and the
        addresses it reads and writes): while it stays equal, a step captured with it may be replayed. Rows joined
        into free rows or freed in place (`write_rows(into=)`, `release_rows`) keep it."""
        return tuple(layer.steady_key() for layer in self.layers) if self.steady else None

    @property
    def version(self) -> int:
        """A count that moves whenever the layers' Python-side state may have changed: each eager call (`update`),
        each row written, freed or moved, storage grown or compacted, the prompt ended. A replayed captured step runs
        no Python and leaves it (`note_replayed_step` advances only the columns seen), so while it stays the same the
        cache's `steady_key` is what it was: the engine's captured steps skip recomputing it (captured.py)."""
        return self.settings.version

    def note_replayed_step(self) -> None:
        """A captured decode step was replayed: the tensors advanced on the device, and the Python-side count of
        columns seen (what transformers counts positions from) advances here as the eager step's would have."""
        for layer in self.layers:
            layer.seen += 1

    # -- inspection -------------------------------------------------------------------------------------
    def row_stats(self, row: int) -> RowStats:
        """What sequence `row` holds now: tokens seen, most kept by a (layer, KV head), the bytes allocated for it
        (its share) and the bytes its kept tokens need (a host sync)."""
        layer = self.layers[0]
        return RowStats(
            kept_tokens=int(self.kept_per_head()[:, row].max()),
            seen_tokens=int(layer.next_pos[row].max()),
            kv_bytes=self.nbytes() // self.batch_size,
            kv_kept_bytes=sum(layer.kept_nbytes(row) for layer in self.layers),
        )

    def kept_map(self, row: int = 0) -> KeptMap:
        """Which (layer, KV head) rows hold each position of sequence `row`, with their scores (kept.py)."""
        return kept_map(self, row)

    @property
    def seen_tokens(self) -> int:
        """Real tokens (padding excluded) that have passed through the cache, longest sequence."""
        layer = self.layers[0] if self.layers else None
        return int(layer.next_pos.max()) if layer is not None and layer.is_initialized and self.batch_size else 0

    @property
    def kept_tokens(self) -> int:
        """Most tokens any (layer, sequence, KV head) holds now."""
        return max(
            (int(layer.kept().max()) for layer in self.layers if layer.is_initialized and layer.kept().numel()),
            default=0,
        )

    def kept_per_head(self) -> torch.Tensor:
        """Kept tokens as [layers, batch, kv_heads]."""
        return torch.stack([layer.kept() for layer in self.layers])

    def layers_alike(self) -> bool:
        """Whether every layer holds each sequence at the same capacity (a host sync per layer). KVzip ranked as one
        cache (`kvzipwhole`) sizes the layers apart when its pass evicted; a context within the budget leaves them
        alike, as every other policy does."""
        sized = [layer.capacity for layer in self.layers if layer.is_initialized and layer.capacity is not None]
        return all(torch.equal(size.view(-1), sized[0].view(-1)) for size in sized[1:])

    def joined_nbytes(self, other: KVCache, rows: int, *, in_place: bool) -> int:
        """Bytes this cache allocates once `other`'s one sequence has joined it (`write_rows`, `into=` a free row when
        `in_place`) and decodes, holding `rows` rows: each layer as wide as `Rows.joined_width` says."""
        total = 0
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            per_slot = mine.nbytes() // (mine.pos.shape[0] * mine.pos.shape[2])  # one row's slot, every field
            total += rows * mine.joined_width(theirs, in_place=in_place) * per_slot
        return total

    def nbytes(self) -> int:
        """Bytes the cache has allocated now (keys, values and the per-slot bookkeeping), the slots its storage
        reserved ahead included: the memory it takes. Summed again only once the cache changed (its `version`):
        the engine reads it after every step."""
        if self._allocated[0] != self.version:
            self._allocated = (self.version, sum(layer.nbytes() for layer in self.layers if layer.is_initialized))
        return self._allocated[1]

    def kept_nbytes(self) -> int:
        """Bytes of the slots that hold a kept token: what the kept tokens need, at most `nbytes()`. Compare caches
        with one measure: a short prompt's `nbytes()` is mostly slots reserved ahead (a host sync per layer)."""
        return sum(layer.kept_nbytes() for layer in self.layers if layer.is_initialized)


@dataclasses.dataclass(frozen=True)
class RowStats:
    """What one sequence of a cache holds (`KVCache.row_stats`)."""

    kept_tokens: int  # most tokens a (layer, KV head) keeps
    seen_tokens: int  # real tokens that went through the cache
    kv_bytes: int  # allocated, this sequence's share
    kv_kept_bytes: int  # held by this sequence's kept tokens


def check_continues(layer: KVLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Refuse, before anything changes, a call that cannot continue what `layer` holds."""
    mine, theirs = (layer.keys.shape[0], layer.kv_heads, layer.keys.shape[3]), (keys.shape[0], *keys.shape[1::2])
    if mine[0] != theirs[0]:
        raise ValueError(
            f"this KVCache holds {mine[0]} sequences but got a batch of {theirs[0]}: a cache belongs to one "
            "model and one batch; use a new KVCache (or cache.reset()) for a different batch"
        )
    if (
        mine != theirs
        or (keys.dtype, keys.device) != (layer.dtype, layer.device)
        or values.shape[-1] != (layer.values.shape[-1])
    ):
        raise ValueError(
            f"this KVCache was filled by another model (layer {layer.layer_idx}: batch x KV heads x head size "
            f"{mine}, {layer.dtype} on {layer.device}; got {theirs}, {keys.dtype} on {keys.device}): a cache "
            "belongs to one model and one batch; use a new KVCache"
        )
    if (
        keys.shape[2] > 1
        and layer.prompt_len is not None
        and not layer.decoded
        and layer.settings.sized_by_prompt
        and layer.settings.prompt_len is None
    ):
        raise ValueError(
            f"{layer.settings.policy.describe()} sizes its budget from the prompt, but the prompt is arriving in "
            "several calls (e.g. generate(..., prefill_chunk_size=...)) and the first one already fixed it: "
            "pass KVCache(..., prompt_len=<prompt tokens>), use token budgets, or KVCache(prefill_chunk=...)"
        )

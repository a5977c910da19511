"""Which cached rows still hold each position of a sequence: `kept_map(cache, row)`, and a bounded summary of it.

When an answer goes wrong under eviction the first question is whether the fact was still in the cache. Every layer
already records it: each slot's absolute position (`pos`, -1 empty) and its policy score, per (sequence, KV head)
(or, in a head-pooled layer, each slot's head in `head`). `kept_map` scatters those into one
[layers, kv_heads, positions] picture of a sequence, after its prompt or after any number of decode steps: no hooks,
no extra work during the forward calls, one scatter per layer. The inspect page (h2o_kv/studies/inspect) draws it;
the server returns `KeptMap.summary` with an answer when a request asks for `kv_inspect`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

MAX_POSITIONS = 2048  # `summary`: per-position values beyond this are averaged over bins of positions
MAX_COLUMNS = 64  # `summary`: the layers x positions picture's columns


@dataclass(frozen=True)
class KeptMap:
    """What one sequence of a cache holds: `kept[l, h, p]` is True where layer l's KV head h keeps position p, and
    `score[l, h, p]` is that slot's policy score (0 where not kept). `heads[l]` is layer l's real KV head count (a
    layer with fewer heads than the widest is padded with False rows); `kept_bytes` the bytes the sequence's kept
    tokens hold."""

    kept: torch.Tensor  # [layers, kv_heads, positions] bool
    score: torch.Tensor  # [layers, kv_heads, positions] float32
    heads: torch.Tensor  # [layers] int64
    kept_bytes: int
    policy: str

    @property
    def positions(self) -> int:
        return self.kept.shape[-1]

    @property
    def rows(self) -> int:
        """(layer, KV head) rows of the sequence: what a kept fraction is a fraction of."""
        return int(self.heads.sum())

    @cached_property
    def _per_layer(self) -> torch.Tensor:
        return self.kept.sum(1)

    def per_layer(self) -> torch.Tensor:
        """Rows of each layer that keep each position, [layers, positions] int64."""
        return self._per_layer

    def count(self) -> torch.Tensor:
        """Rows that keep each position, [positions] int64."""
        return self._per_layer.sum(0)

    def fraction(self) -> torch.Tensor:
        """The share of all rows that keep each position, [positions] float32 in [0, 1]."""
        return self.count().float() / max(self.rows, 1)

    def layer_fraction(self) -> torch.Tensor:
        """The share of each layer's heads that keep each position, [layers, positions] float32."""
        return self.per_layer().float() / self.heads.clamp(min=1).view(-1, 1).float()

    def mean_score(self) -> torch.Tensor:
        """Each position's score averaged over the rows that keep it (0 where none does), [positions] float32."""
        return self.score.sum((0, 1)) / self.count().clamp(min=1).float()

    @cached_property
    def _per_row(self) -> torch.Tensor:
        return self.kept.sum(-1)

    def kept_per_row(self) -> torch.Tensor:
        """Positions each (layer, KV head) keeps, [layers, kv_heads] int64 (padded heads: 0)."""
        return self._per_row

    def summary(self, prompt_tokens: int | None = None, *, max_positions: int = MAX_POSITIONS,
                max_columns: int = MAX_COLUMNS) -> dict:  # fmt: skip
        """A JSON-ready, bounded account of the first `prompt_tokens` positions (all by default): the kept fraction
        of each position (averaged over bins of `bin` positions past `max_positions`), of each layer, and a layers x
        positions grid of at most `max_columns` columns. A few tens of KB whatever the prompt."""
        n = self.positions if prompt_tokens is None else max(0, min(prompt_tokens, self.positions))
        fraction = self.fraction()[:n]
        per_layer = self.layer_fraction()[:, :n]
        width = max(1, math.ceil(n / max_positions))
        columns = max(1, math.ceil(n / max_columns))
        return {
            "policy": self.policy,
            "layers": int(self.kept.shape[0]),
            "kv_heads": int(self.heads.max()) if self.heads.numel() else 0,
            "seen_tokens": self.positions,
            "prompt_tokens": n,
            "kept_bytes": self.kept_bytes,
            "kept_tokens": int(self.kept_per_row().max()),  # most a (layer, KV head) keeps, as `row_stats`
            "kept_fraction": round(float(self.count()[:n].sum()) / max(self.rows * n, 1), 4),
            "bin": width,
            "position_kept_fraction": _rounded(binned(fraction[None], width)[0]),
            "layer_kept_fraction": _rounded(per_layer.mean(1) if n else per_layer.sum(1)),
            "grid_bin": columns,
            "layer_position_kept_fraction": [_rounded(line) for line in binned(per_layer, columns)],
        }

    def cpu(self) -> KeptMap:
        return KeptMap(self.kept.cpu(), self.score.cpu(), self.heads.cpu(), self.kept_bytes, self.policy)


def binned(values: torch.Tensor, width: int) -> torch.Tensor:
    """The mean of each run of `width` columns of `values` [rows, n] (the last may be shorter): [rows, bins]."""
    n = values.shape[-1]
    if width <= 1 or n == 0:
        return values
    bins = math.ceil(n / width)
    padded = torch.nn.functional.pad(values, (0, bins * width - n))
    counts = torch.full((bins,), float(width), device=values.device)
    counts[-1] = n - (bins - 1) * width
    return padded.view(values.shape[0], bins, width).sum(-1) / counts


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(v, 3) for v in values.tolist()]


def kept_map(cache, row: int = 0) -> KeptMap:
    """Which (layer, KV head) rows of `cache` hold each position of sequence `row`, after its prompt or any number of
    decode steps: positions count the sequence's real tokens (padding excluded), 0 to what it has seen. Reads what
    the layers already hold; one scatter per layer."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if not layers:
        raise ValueError("kept_map needs a cache that has seen a prompt: this one holds nothing yet")
    batch = layers[0].pos.shape[0]
    if not 0 <= row < batch:
        raise ValueError(f"kept_map takes a row in [0, {batch}), got {row}")
    if any(layer.pending is not None for layer in layers):
        raise ValueError("cannot map a cache in the middle of a forward call")
    first = layers[0]
    device = first.pos.device
    n = int(first.next_pos[row].max())
    width = max(layer.kv_heads for layer in layers)
    kept = torch.zeros(len(cache.layers), width, n, dtype=torch.bool, device=device)
    score = torch.zeros(len(cache.layers), width, n, dtype=torch.float32, device=device)
    heads = torch.zeros(len(cache.layers), dtype=torch.int64, device=device)
    for index, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        heads[index] = layer.kv_heads
        pos = layer.pos[row]  # [H, S], or [1, S] in a head-pooled layer
        if layer.head is not None:
            head = layer.head[row].long()
        else:
            head = torch.arange(pos.shape[0], device=device).view(-1, 1).expand_as(pos)
        held = (pos >= 0) & (pos < n)
        where = (head[held], pos[held])
        kept[index].index_put_(where, torch.ones_like(where[0], dtype=torch.bool))
        score[index].index_put_(where, layer.score[row][held].float())
    return KeptMap(kept, score, heads, cache.row_stats(row).kv_kept_bytes, cache.policy.describe())

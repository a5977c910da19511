"""What the layers of one cache share: its settings, and which columns of a forward call are real tokens."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from h2o_kv.model_config import text_config
from h2o_kv.policies import Policy

Mode = Literal["drop", "mask"]


class PaddingMemo:
    """Which new columns of a forward call are real tokens: computed once per call, shared by the layers."""

    def __init__(self) -> None:
        self._memo: tuple | None = None

    def real_tokens(
        self, mask: torch.Tensor | None, batch: int, n: int, device: torch.device
    ) -> tuple[torch.Tensor, bool]:
        """[B, n] True for real tokens, and whether any column is padding."""
        if self._memo is not None and self._memo[0] is mask and self._memo[1].shape == (batch, n):
            return self._memo[1], self._memo[2]
        if n == 1 and capturing():  # a decode step's one column is a real token; checking it would need the host
            return torch.ones(batch, 1, dtype=torch.bool, device=device), False
        real = _real_tokens(mask, batch, n, device)
        self._memo = (mask, real, not bool(real.all()))
        return real, self._memo[2]


@dataclass
class Settings:
    """What every layer of one cache shares: the policy and how to apply it."""

    policy: Policy
    mode: Mode = "drop"
    prefill_chunk: int | None = None
    prompt_len: int | None = None  # size budgets from this many prompt tokens instead of the first call's
    padding: PaddingMemo | None = None
    kv_dtype: str | None = None  # "int8": keys and values stored quantized with per-token scales (quant.py)
    compile_kernel: bool = False  # CPU decode steps over float32, int8 or head-pooled storage run native.py's kernels
    headroom: int = 0  # tokens per (sequence, KV head) held past the budget once the prompt is complete (layer.py)

    def __post_init__(self) -> None:
        self._work: torch.Tensor | None = None
        if self.padding is None:
            self.padding = PaddingMemo()
        self.sized_by_prompt = self.policy.fraction_of_prompt()
        self.warned = False  # a budget that keeps very few tokens is warned about once per cache (layer.py)
        self.past_context = False  # a sequence went past the model's context: warned once per cache
        self.reconstruction = None  # KVzip's pass while it runs (reconstruct.Reconstruction)
        # the attention function of the layers' calls while set, in place of `routes.attend` (same arguments and
        # results): a study replaying one recorded prefill into many caches computes each call's scores once
        self.attention = None
        # while set, the peaks of a recorded KVzip pass (`reconstruct.PassPeaks`): each scoring call's peak attention
        # computed once, by the recording's run or the first replay, for every cache the pass is replayed into
        self.peaks = None
        # moves with every change of the layers' Python-side state: each eager call, each row written, freed or moved,
        # storage grown or compacted (`KVCache.version`); a replayed captured step runs no Python and leaves it
        self.version = 0

    def check_context(self, seen: int, next_pos: torch.Tensor, config) -> None:
        """Warn, once per cache, when a sequence's positions go past the model's context (`max_position_embeddings`
        of `config`): a bounded cache bounds memory, not positions, and a model read at positions it was never
        trained on degrades whatever is kept. `seen` (columns, padding included) bounds the positions without a
        sync; the positions themselves are read only past that bound, and never inside a captured step."""
        context = getattr(text_config(config), "max_position_embeddings", None) if config is not None else None
        if self.past_context or not context or seen <= context or capturing():
            return
        last = int(next_pos.max())
        if last > context:
            self.past_context = True
            warnings.warn(
                f"this KVCache's sequence reached position {last}, past the model's context of {context} tokens: "
                "the model was not trained there and its output degrades whatever the cache keeps",
                stacklevel=4,
            )

    @property
    def compileable(self) -> bool:
        """Whether a decode step runs without a host sync once the storage is full, so that `torch.compile` and CUDA
        graphs take it: drop mode (mask mode grows its storage every step) with one storage row per KV head."""
        return self.mode == "drop" and not self.policy.head_pooled

    def work(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, shared by the cache's layers (they run one after
        another) and kept between steps: where int8 storage (or bfloat16 on a CPU) is widened for a decode
        step's float products (attend.widen). It is working memory, like the attention logits, so
        `nbytes()` does not count it; it is one layer's keys and values in float."""
        work = self._work
        if work is None or work.numel() < numel or work.dtype != dtype or work.device != device:
            work = self._work = torch.empty(numel, dtype=dtype, device=device)
        return work


def capturing() -> bool:
    """Inside a CUDA graph capture or a torch.compile trace, where the host cannot read device values."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _real_tokens(mask: torch.Tensor | None, batch: int, n: int, device: torch.device) -> torch.Tensor:
    """[B, n] True for real tokens. A real token always attends to itself, padding never does."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    diag = mask[:, 0].diagonal(dim1=-2, dim2=-1)
    if diag.dtype != torch.bool:  # additive float mask: 0 where attended
        diag = diag == 0
    return diag.expand(batch, n)

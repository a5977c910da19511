"""The engine's decode steps on a GPU: each batch's steady step recorded once per batch bucket and replayed.

A bounded policy's batch keeps its rows in place in a bucket of rows (batch.py: 1, 2, 4, 8, ...), so its decode
step has the bucket's shapes and, once every layer is full (`KVCache.steady`), reads and writes the same memory
every step: a request joins by writing a free row and leaves by freeing its row, and neither moves the storage.
`CapturedSteps` records that step once as a CUDA graph (`CudaGraphs`) and replays it while the cache's
`steady_key` (the step's route and the addresses it touches) is the one it was recorded with, so the host's
thousands of kernel launches per step become one; the key is computed again only after something changed the cache
on the host (its `version`: an eager call, a row written or freed), not before every replay. When the key changes
(the bucket grew or shrank, a layer's storage grew) it records again, after `warmup` eager steady steps (they
compile the Triton kernels for the new shapes); a step that is not steady (the first of a new bucket) runs eagerly, as
everywhere on a CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.generation import forward
from h2o_kv.runtime.steps import EagerSteps


class CudaGraphs:
    """How a step is recorded and replayed on a GPU: one CUDA graph per batch (its own memory pool)."""

    def record(self, step: Callable[[], torch.Tensor], cache: KVCache) -> tuple[Callable[[], None], torch.Tensor]:
        """Capture `step` (one decode step of `cache`) and run it once; returns the replay (one more step, with the
        cache's Python-side count advanced as an eager step would: `note_replayed_step`) and the output buffer."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()  # capturing recorded the step without running it
        held = weakref.ref(cache)  # the recording lives as long as its cache (`CapturedSteps.recorded`), no longer

        def replay() -> None:
            graph.replay()
            held().note_replayed_step()

        return replay, out


@dataclass
class Recorded:
    """A batch's recorded step: the `steady_key` it holds for, its static inputs and output, and its replay."""

    key: tuple
    eager: int = 0  # eager steady steps run with this key (the warm-up)
    version: int = -1  # the cache's `version` when the key was last found equal (-1: not yet)
    replay: Callable[[], None] | None = None
    tokens: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class CapturedSteps(EagerSteps):
    """`EagerSteps` whose steady decode steps are replayed from a recording per batch (`graphs`: `CudaGraphs` by
    default; a test passes a stand-in). `captured` and `replayed` count recordings and replays."""

    def __init__(self, model: torch.nn.Module, *, eos: set[int], prefill_chunk: int | None,
                 held: Callable[[], None], warmup: int = 1, graphs=None) -> None:  # fmt: skip
        super().__init__(model, eos=eos, prefill_chunk=prefill_chunk, held=held)
        self.graphs = CudaGraphs() if graphs is None else graphs
        self.warmup = warmup
        self.recorded: weakref.WeakKeyDictionary[KVCache, Recorded] = weakref.WeakKeyDictionary()
        self.captured = self.replayed = 0

    def _decode_call(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row (tokens, positions [B]): the next logits [B, V], from the batch's recording when its
        cache is steady with the key it was recorded with (the logits then live in the recording's output buffer,
        overwritten by its next replay). Nothing changed the cache since its key was last found equal (its `version`
        is the same: no eager call, no row written or freed): replayed without recomputing the key, a few
        microseconds a layer of host work the GPU would wait for."""
        held = self.recorded.get(cache)
        if held is not None and held.replay is not None and held.version == cache.version:
            return self._replay(held, tokens, positions)
        key = cache.steady_key()
        if key is None:
            return super()._decode_call(cache, tokens, positions)
        if held is None or held.key != key:  # a new bucket or storage: the old recording (and its memory) goes
            held = self.recorded[cache] = Recorded(key)
        if held.replay is not None:
            held.version = cache.version
            return self._replay(held, tokens, positions)
        if held.eager < self.warmup:
            held.eager += 1
            return super()._decode_call(cache, tokens, positions)
        held.tokens, held.positions = tokens.view(-1, 1).clone(), positions.view(-1, 1).clone()
        held.replay, held.logits = self.graphs.record(
            lambda: forward(self.model, cache, held.tokens, positions=held.positions), cache
        )
        held.key = cache.steady_key()  # what the recorded step left (the same, unless it allocated inside)
        held.version = cache.version
        self.captured += 1
        return held.logits

    def _replay(self, held: Recorded, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        held.tokens.copy_(tokens.view(-1, 1))
        held.positions.copy_(positions.view(-1, 1))
        held.replay()
        self.replayed += 1
        return held.logits

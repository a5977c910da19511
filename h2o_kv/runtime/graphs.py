"""A steady decode step captured once as a CUDA graph and replayed: one launch for the whole model's step.

Once every layer of a drop-mode `KVCache` is full, a decode step has fixed shapes and touches the same
memory every time: the new token goes into the slot the last step freed (a buffer the layer keeps), the
positions advance in place, the scores accumulate in place, and nothing reads a device value on the host.
So the model's forward over one token per sequence can be captured as a CUDA graph and replayed, as
transformers' `StaticCache` is under `torch.compile(mode="reduce-overhead")`; the replay skips the host's
thousands of kernel launches. `CapturedStep` runs eager steps until the cache is steady (`KVCache.steady`),
captures the next one, and replays from then on (`KVCache.note_replayed_step` keeps the Python-side count).
"""

from __future__ import annotations

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.generation import forward


class CapturedStep:
    """Greedy or sampled decoding's model call, one token per sequence, replayed from a CUDA graph once steady.

    `step(tokens [B], positions [B])` returns the logits [B, V] (float32); they live in the graph's output buffer
    and are overwritten by the next step. Eager steps run until `cache.steady` and `warmup` more have passed
    (they compile Triton kernels and settle the allocator); the step after that is captured.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, *, warmup: int = 2) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CapturedStep needs a model on a CUDA device, got {model.device}")
        self.model, self.cache, self.warmup = model, cache, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steady_steps = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.tokens.copy_(tokens.view(-1, 1))
            self.positions.copy_(positions.view(-1, 1))
            self.graph.replay()
            self.cache.note_replayed_step()
            return self.logits
        steady = self.cache.steady
        if not steady or self.steady_steps < self.warmup:
            self.steady_steps += steady
            return forward(self.model, self.cache, tokens.view(-1, 1), positions=positions.view(-1, 1))
        self.tokens, self.positions = tokens.view(-1, 1).clone(), positions.view(-1, 1).clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = forward(self.model, self.cache, self.tokens, positions=self.positions)
        self.graph.replay()  # capturing recorded the step without running it
        return self.logits

"""KVzip's reconstruction pass in the engine: one request's pass (`KVCache.reconstruction()`), spread over steps.

A request whose policy `reconstructs` (KVzip) and whose cache is new (not a fork from the prefix store) prefills
inside the pass. Its prompt goes in held, one `prefill_chunk` per engine step: nothing is evicted, so each held
chunk's logits are the full cache's, and the first token is sampled from the last one's, as for every other
policy. Then the reconstruction calls (`compress.reconstruction_inputs` of the prompt, in chunks of the engine's
`prefill_chunk`, `compress.CHUNK` without one) are fed one per step, each a scoring call (`compress.score_piece`:
it starts where the prompt ends, and is dropped). Then the pass is left: each (layer, KV head) keeps its capacity
of best-scored tokens, the storage shrinks to them (drop mode), and the request joins its policy's batch, or ends
there if its first token ended it (so a kept prefix is the compressed cache). That is `compress_with_logits` on
one cache, then decoding from its logits, with the prompt's call cut into chunks.

The pass spans steps, so `Reconstructing` enters it when the request is admitted and leaves it explicitly
(`leave`): with an error (a failed call, or a cancelled request) the pass empties the cache. A request that forks
a kept prefix runs no pass: its new tokens go in as any prompt's, under KVzip's decoding rule (as a question fed
after `h2o_kv.compress`).
"""

from __future__ import annotations

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.compress import CHUNK, reconstruction_inputs, score_piece


class Reconstructing:
    """The pass of one request over its new `cache`: the `prompt` [ids] held in calls of `chunk` tokens (None: one
    call), then its reconstruction calls, one per engine step. Enters the pass on creation."""

    def __init__(self, cache: KVCache, prompt: list[int], tokenizer, chunk: int | None, device) -> None:
        self.cache, self.length = cache, len(prompt)
        ids = torch.tensor([prompt], device=device)
        self.mask = torch.ones_like(ids)
        self.pieces = reconstruction_inputs(tokenizer, ids, self.mask, chunk or CHUNK)
        self.scored = 0  # reconstruction calls fed
        self.rec = cache.reconstruction()
        self.rec.__enter__()
        self.open = True

    @property
    def held(self) -> bool:
        """Whether the whole prompt is in (the next call is a reconstruction call)."""
        return self.cache.seen_tokens >= self.length

    @property
    def pieces_left(self) -> int:
        """Reconstruction calls left (the held chunks before them are the scheduler's `calls_left`, as any prompt's)."""
        return len(self.pieces) - self.scored

    def score_next(self, model) -> None:
        """Feed the next reconstruction call (the prompt must be held)."""
        piece, piece_mask = self.pieces[self.scored]
        score_piece(model, self.cache, self.rec, piece, piece_mask, self.mask)
        self.pieces[self.scored] = None  # fed: its tensors can go
        self.scored += 1

    def leave(self, error: BaseException | None = None) -> None:
        """Leave the pass: ranked to each (layer, KV head)'s capacity and, in drop mode, shrunk to what is kept; with
        `error`, emptied. Once only."""
        if not self.open:
            return
        self.open = False
        if error is not None:
            self.rec.__exit__(type(error), error, error.__traceback__)
            return
        self.rec.__exit__(None, None, None)
        self.cache.end_prompt()
        if self.cache.mode == "drop":  # a prompt within its capacity left the last call's slots allocated
            self.cache.select_rows([0])

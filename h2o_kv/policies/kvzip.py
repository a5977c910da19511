"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416).

Query-agnostic: a context is compressed before its question is known by asking the model to repeat it. After the
context is prefilled whole, "Repeat the previous context exactly." and the context again are fed in chunks
(`h2o_kv.compress`, runtime/compress.py); each chunk attends to the kept context and causally to itself and is
then dropped (cache/reconstruct.py). A context token's score is the most attention it received from those
reconstruction queries (the max over the queries and the group's query heads): the tokens the model needs to
rebuild the context. Each (sequence, KV head) then keeps its capacity of best-scored context tokens; with
`whole_cache=True` (the paper's default allocation, in AdaKV's head-pooled rows: `build("kvzipwhole", budget)`) the
tokens of every head of every layer are ranked together and each layer keeps what the ranking gives it.

Decoding afterwards holds the capacity as H2O does: scores keep accumulating the attention each token receives
(on top of its reconstruction score; a new token starts at 0), the newest min(`recent`, ceil(budget / 2)) tokens
that came after the context are kept, and the lowest score among the others goes first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import BudgetAndRecent, SlotState, per_prompt


@dataclass(frozen=True)
class KVzip(BudgetAndRecent):
    """Context-reconstruction scores (through `h2o_kv.compress`), then H2O-style accumulation while decoding.

    `budget`: tokens per (sequence, KV head), or a float fraction of the context. `whole_cache`: when the pass ends,
    one ranking over the whole cache (every layer's budget summed) in place of one per (layer, KV head).
    """

    whole_cache: bool = False

    needs_scores = True
    reconstructs = True

    def priority(self, state: SlotState) -> torch.Tensor:
        return torch.where(state.pos >= state.next_pos - self.protected_recent(state), float("inf"), state.score)

    def protected_recent(self, state: SlotState) -> torch.Tensor:
        # the newest tokens, but none of the context (`prompt_len`): compression is the pure top-capacity by score
        after_context = (state.next_pos - state.prompt_len).clamp(min=0)
        return torch.minimum(per_prompt(state, "recent", self.split), after_context)

    def describe(self) -> str:
        whole = ", whole_cache=True" if self.whole_cache else ""
        return f"KVzip(budget={self.budget:g}, recent={self.recent}{whole})"


def ranks_whole_cache(policy) -> bool:
    """Whether `policy` (or one it wraps) ranks the whole cache at once when KVzip's pass ends (`whole_cache=True`)."""
    while policy is not None:
        if getattr(policy, "whole_cache", False):
            return True
        policy = getattr(policy, "inner", None)
    return False

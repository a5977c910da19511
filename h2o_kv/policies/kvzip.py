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

With `window` (h2o-kv's addition, for a prompt whose question may be inside it or come after it): the pass also
keeps the context's own last `window` queries, as SnapKV's observation window does, and in each row the `share` of
its capacity that those queries attend to most ranks above every reconstruction score; the newest `window` tokens
(the context's end, then the newest ones) are kept whatever their rank. A question inside the prompt then keeps
what it asks about, and the reconstruction ranks the rest for questions that come later. `build("kvzipwindow", b)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import BudgetAndRecent, SlotState, check_budget, per_prompt


@dataclass(frozen=True)
class KVzip(BudgetAndRecent):
    """Context-reconstruction scores (through `h2o_kv.compress`), then H2O-style accumulation while decoding.

    `budget`: tokens per (sequence, KV head), or a float fraction of the context. `whole_cache`: when the pass ends,
    one ranking over the whole cache (every layer's budget summed) in place of one per (layer, KV head). `window`
    (0: off) and `share`: the context's last `window` queries pick `share` of each row's capacity first, and the
    newest `window` positions are protected (module docstring; the rule is docs/eviction.md's).
    """

    whole_cache: bool = False
    window: int = 0
    share: float = 0.6

    def __post_init__(self) -> None:
        super().__post_init__()
        check_budget("window", self.window, allow_zero=True)
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) or not 0 < self.share <= 1:
            raise ValueError(f"share must be a fraction of a row's capacity in (0, 1], got {self.share!r}")

    needs_scores = True
    reconstructs = True

    def priority(self, state: SlotState) -> torch.Tensor:
        return torch.where(state.pos >= state.next_pos - self.protected_recent(state), float("inf"), state.score)

    def protected_recent(self, state: SlotState) -> torch.Tensor:
        # the newest tokens after the context (`prompt_len`), and with a window the newest `window` more: without one
        # compression is the pure top-capacity by score
        after_context = (state.next_pos - state.prompt_len).clamp(min=0)
        recent = torch.minimum(per_prompt(state, "recent", self.split), after_context)
        if not self.window:
            return recent
        return torch.minimum(recent + self.window, per_prompt(state, "half", self.half))

    def describe(self) -> str:
        whole = ", whole_cache=True" if self.whole_cache else ""
        window = f", window={self.window}, share={self.share:g}" if self.window else ""
        return f"KVzip(budget={self.budget:g}, recent={self.recent}{whole}{window})"


def kvzip_of(policy) -> KVzip | None:
    """The KVzip `policy` is or wraps (AdaKV, Sinks, ...), or None."""
    while policy is not None and not isinstance(policy, KVzip):
        policy = getattr(policy, "inner", None)
    return policy


def ranks_whole_cache(policy) -> bool:
    """Whether `policy` (or one it wraps) ranks the whole cache at once when KVzip's pass ends (`whole_cache=True`)."""
    kvzip = kvzip_of(policy)
    return kvzip is not None and kvzip.whole_cache

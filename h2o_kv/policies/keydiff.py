"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364).

Query-agnostic: a token is ranked by its key alone, so a context compressed before its question is known keeps
what any question may need. The anchor of a (sequence, KV head) is the mean of its kept keys, each normalised to
unit length; a key close to the anchor says what many others say already, a distinctive one (low cosine
similarity) is kept. No attention scores are needed, so a prompt takes the fused attention path (SDPA).

The paper ranks every cached token. Here the newest min(`recent`, ceil(budget / 2)) tokens are kept as well: a
token just generated (or the end of a prompt) is the local context the next token needs, and a key that happens
to point like the anchor would otherwise be evicted right after its first step. `recent=0` is the paper's rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv.policies.base import BudgetAndRecent, SlotState, per_prompt


@dataclass(frozen=True)
class KeyDiff(BudgetAndRecent):
    """Keeps the keys least similar to the (sequence, KV head)'s mean normalised key, plus a few newest tokens.

    `budget`: tokens per (sequence, KV head), or a float fraction of the prompt.
    """

    needs_keys = True

    def priority(self, state: SlotState) -> torch.Tensor:
        assert state.keys is not None
        unit = torch.nn.functional.normalize(state.keys, dim=-1)  # [B, H, S, D]
        kept = (state.pos >= 0).to(unit.dtype).unsqueeze(-2)  # [B, H, 1, S]: empty slots stay out of the anchor
        anchor = torch.matmul(kept, unit)  # [B, H, 1, D]: the mean's direction (cosines ignore its length)
        cosine = torch.matmul(unit, anchor.mT).squeeze(-1) / anchor.norm(dim=-1).clamp_min(1e-12)
        recent = per_prompt(state, "recent", self.split)
        return torch.where(state.pos >= state.next_pos - recent, float("inf"), -cosine)

    def describe(self) -> str:
        return f"KeyDiff(budget={self.budget:g}, recent={self.recent})"

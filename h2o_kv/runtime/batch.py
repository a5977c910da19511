"""One policy group's running batch: its cache, the request in each of the cache's rows, and their next inputs.

Requests with the same policy and budget decode together: one `KVCache` holds their sequences, one forward call
steps them all. A request joins when its prompt is through (`join`: its prefilled cache's rows are written in) and
leaves when it finishes or is cancelled (`leave`: its rows are freed); `requests[i]` is the request in row i. The
next step's inputs live here as tensors on the model's device: each row's last token and its position, advanced
in place after each step, so a step builds nothing from Python lists but the tokens sampled on the host.
"""

from __future__ import annotations

import dataclasses

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.request import Request


class Batch:
    """The decoding rows of one policy: `cache` row i is `requests[i]`."""

    def __init__(self, request: Request, cache: KVCache, device: torch.device) -> None:
        self.cache, self.requests = cache, [request]
        self.tokens = torch.tensor([request.token_ids[-1]], device=device)
        self.positions = torch.tensor([request.position], device=device)

    def __len__(self) -> int:
        return len(self.requests)

    def join(self, request: Request, cache: KVCache) -> None:
        """Take in a request whose prompt has been through `cache` (its one row) and whose first token is sampled."""
        self.cache.write_rows(cache)
        self.requests.append(request)
        new = [request.token_ids[-1]], [request.position]
        self.tokens = torch.cat([self.tokens, self.tokens.new_tensor(new[0])])
        self.positions = torch.cat([self.positions, self.positions.new_tensor(new[1])])

    def advance(self, tokens: list[int | None], greedy: torch.Tensor | None) -> None:
        """After a decode step: each row's next input is the token it sampled (`greedy`, the step's argmax on the
        device, when every row decodes greedily; None for a row whose sampling failed, which leaves), one position
        on."""
        self.tokens = greedy if greedy is not None else self.tokens.new_tensor([t or 0 for t in tokens])
        self.positions.add_(1)

    def leave(self, rows: list[int]) -> None:
        """Free these rows; the others keep their order."""
        gone = set(rows)
        keep = [i for i in range(len(self.requests)) if i not in gone]
        self.cache.free_rows(rows)
        self.requests = [self.requests[i] for i in keep]
        index = torch.tensor(keep, device=self.tokens.device)
        self.tokens, self.positions = self.tokens[index], self.positions[index]

    def record(self, row: int) -> None:
        """What the request in `row` held at its end, in its `cache_stats`: kept and seen tokens, and its bytes."""
        self.requests[row].cache_stats = record_of(self.cache, row)


def record_of(cache: KVCache, row: int) -> dict:
    """A request's `cache_stats` from its cache's row (`KVCache.row_stats`)."""
    return dataclasses.asdict(cache.row_stats(row))

"""One policy group's running batch: its cache, the request in each of the cache's rows, and their next inputs.

Requests with the same policy and budget decode together: one `KVCache` holds their sequences, one forward call
steps them all. A request joins when its prompt is through (`join`: its prefilled cache's rows are written in) and
leaves when it finishes or is cancelled (`leave`: its rows are freed); `requests[i]` is the request in cache row
`rows[i]`. The next step's inputs live here as tensors on the model's device: each row's last token and its
position, advanced in place after each step, so a step builds nothing from Python lists but the tokens sampled on
the host.

Rows in place (`in_place`, the engine's default on a GPU, for a bounded drop-mode policy): the cache holds a bucket
of rows (1, 2, 4, 8, ... up to the engine's `max_batch`), a request joins a free row and leaves its row free, so no
other row's storage is copied (`KVCache.write_rows(into=)`, `release_rows`), and the step's shapes stay those of
the bucket (what a captured step replays). Free rows step along, fed token 0 at position 0; their logits are never
read. The bucket grows when no row is free and shrinks, packing the rows, once a quarter of it is in use. Prompts of
the same policy still going in (`coming`) count as rows in use: a batch started or grown while they prefill takes
their bucket at once, and one they will join does not shrink below it; and the storage is made as wide as the widest
of them needs (`width`) before a row joins. So a new bucket or a wider storage (a copy, and on a GPU a new recording
of the step) is not made again and again while the batch fills (admission already counts these rows and widths:
`Scheduler.projected`). Where the next power of two would not fit the engine's KV memory (`tight`, the scheduler's
call), a bucket is just the rows in use: more requests decode in the same bytes, at the price of a recording per
size.
"""

from __future__ import annotations

import dataclasses

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.request import Request


class Batch:
    """The decoding rows of one policy: `requests[i]` is in `cache` row `rows[i]`. `max_rows`: keep rows in place
    in buckets of rows up to this many (None: rows packed, the cache as wide as the requests)."""

    def __init__(self, request: Request, cache: KVCache, device: torch.device, max_rows: int | None = None,
                 coming: int = 0, width: int = 0, tight: bool = False) -> None:  # fmt: skip
        self.cache, self.requests, self.rows = cache, [request], [0]
        self.max_rows = max_rows if max_rows is not None and cache.rows_in_place else None
        self.tokens = torch.tensor([request.token_ids[-1]], device=device)
        self.positions = torch.tensor([request.position], device=device)
        if self.in_place:
            cache.reserve_width(width)
            rows = bucket(1 + coming, self.max_rows, tight)  # room for the prompts about to join
            if rows > 1:
                self._resize(rows)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def in_place(self) -> bool:
        return self.max_rows is not None

    def join(self, request: Request, cache: KVCache, width: int = 0, coming: int = 0, tight: bool = False) -> None:
        """Take in a request whose prompt has been through `cache` (its one row) and whose first token is sampled.
        In place, the storage is first made `width` slots wide (the widest row of the batch and its coming prompts:
        `KVCache.reserve_width`), where it is narrower, and grown to the bucket of its rows and the `coming` prompts
        when no row is free."""
        token, position = request.token_ids[-1], request.position
        self.requests.append(request)
        if not self.in_place:
            self.cache.write_rows(cache)
            self.rows.append(len(self.rows))
            self.tokens = torch.cat([self.tokens, self.tokens.new_tensor([token])])
            self.positions = torch.cat([self.positions, self.positions.new_tensor([position])])
            return
        self.cache.reserve_width(width)
        row = self._free_row(coming, tight)
        self.cache.write_rows(cache, into=row)
        self.rows.append(row)
        self.tokens[row], self.positions[row] = token, position

    def rows_after_join(self, coming: int = 0, tight: bool = False) -> int:
        """The cache rows this batch holds once one more request has joined: one more (rows packed), the same where a
        row is free, else the bucket of its rows and the `coming` prompts."""
        if not self.in_place:
            return self.cache.batch_size + 1
        if len(self.rows) < self.cache.batch_size:
            return self.cache.batch_size
        return bucket(len(self.rows) + 1 + coming, self.max_rows, tight)

    def _free_row(self, coming: int, tight: bool) -> int:
        """The first free row of the cache, after growing it to the next bucket when none is free."""
        taken = set(self.rows)
        free = [row for row in range(self.cache.batch_size) if row not in taken]
        if free:
            return free[0]
        self._resize(self.rows_after_join(coming, tight))
        return len(self.rows)

    def _resize(self, rows: int) -> None:
        """Hold `rows` rows, the new ones free (a copy of the storage: once per bucket)."""
        self.cache.reserve_rows(rows)
        extra = rows - self.tokens.shape[0]
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(extra)])
        self.positions = torch.cat([self.positions, self.positions.new_zeros(extra)])

    def advance(self, tokens: list[int | None], greedy: torch.Tensor | None) -> None:
        """After a decode step: each row's next input is the token it sampled (`greedy`, the step's argmax on the
        device for every cache row, when every request decodes greedily; None for a row whose sampling failed,
        which leaves), one position on."""
        if greedy is not None:
            self.tokens = greedy
        else:
            self.tokens[self.rows] = self.tokens.new_tensor([t or 0 for t in tokens])
        self.positions.add_(1)

    def leave(self, gone: list[int], coming: int = 0, width: int = 0, tight: bool = False) -> None:
        """These requests (indices into `requests`) leave: their rows are freed; the others keep their order. In place,
        the bucket shrinks once a quarter of it is in use, counting the `coming` prompts that will join, and packing
        the rows narrows the storage to what they hold: it is widened again to the `width` those prompts need."""
        rows = [self.rows[i] for i in gone]
        keep = [i for i in range(len(self.requests)) if i not in set(gone)]
        self.requests = [self.requests[i] for i in keep]
        if not self.in_place:
            self.cache.free_rows(rows)
            index = torch.tensor(keep, device=self.tokens.device)
            self.tokens, self.positions = self.tokens[index], self.positions[index]
            self.rows = list(range(len(keep)))
            return
        self.cache.release_rows(rows)
        self.tokens[rows], self.positions[rows] = 0, 0
        self.rows = [self.rows[i] for i in keep]
        if len(self.rows) + coming <= self.cache.batch_size // 4:  # a quarter in use: pack into a smaller bucket
            index = torch.tensor(self.rows, device=self.tokens.device)
            self.cache.select_rows(self.rows)
            self.tokens, self.positions = self.tokens[index], self.positions[index]
            self.rows = list(range(len(self.rows)))
            self._resize(bucket(len(self.rows) + coming, self.max_rows, tight))
            self.cache.reserve_width(width)

    def record(self, i: int) -> None:
        """What request `i` held at its end, in its `cache_stats`: kept and seen tokens, and its bytes."""
        record(self.requests[i], self.cache, self.rows[i])


def bucket(rows: int, most: int, tight: bool = False) -> int:
    """The rows a batch of `rows` requests holds in place: the next power of two, at most `most` (and at least
    `rows`); `tight`: `rows` (the power of two would not fit the KV memory)."""
    return rows if tight else max(rows, min(1 << (rows - 1).bit_length(), most))


def record(request: Request, cache: KVCache, row: int) -> None:
    """A request's `cache_stats` from its cache's row (`KVCache.row_stats`), with `kv_inspect` the summary of its
    kept map over its prompt (`KVCache.kept_map`: a few tens of KB)."""
    stats = dataclasses.asdict(cache.row_stats(row))
    if request.kv_inspect:
        stats["kept_map"] = cache.kept_map(row).summary(request.prompt_tokens)
    request.note_stats(stats)

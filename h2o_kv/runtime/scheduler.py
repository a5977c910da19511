"""Who runs next: the queue of submitted requests, the prompts going in, the decoding batches; admission by KV memory.

A request waits (`waiting`, FIFO) until its KV memory fits beside everyone running (`admit`: `projected` bytes
within `kv_memory`, at most `max_batch` running); then its prompt goes in, one chunk per engine step, oldest first
(`prefill`), except that a prompt one chunk finishes goes before it (`prefill_turn`: a reused prefix's few new
tokens never wait behind other prompts' long prefills); then it decodes in its policy's `Batch`. A KVzip request
with a new cache prefills inside its reconstruction pass (`passes`: reconstructing.py), its held chunks then its
reconstruction calls one per step; `prefill_turn` counts both. Nothing here calls the model: the engine does.

With a prefix store (`prefixes.py`, the engine's `session_memory`), a request that ends with its answer leaves its
cache behind (`keep`), and an admitted request whose prompt extends a kept sequence starts from a fork of it. Kept
bytes are reclaimable: admission drops them (least recently used first) to make room, so running requests plus kept
caches stay within `kv_memory`, and no request waits for them.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Hashable

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import Policy
from h2o_kv.policies.kvzip import ranks_whole_cache
from h2o_kv.runtime.admission import SlotCount
from h2o_kv.runtime.batch import Batch, bucket
from h2o_kv.runtime.prefixes import PrefixStore
from h2o_kv.runtime.reconstructing import Reconstructing
from h2o_kv.runtime.request import Request

log = logging.getLogger(__name__)


class Scheduler:
    """The requests of one engine by stage; `new_cache(request)` makes an admitted request's cache and
    `new_pass(request, cache)` the reconstruction pass of a new one whose policy `reconstructs`; `prefixes` keeps
    finished requests' caches for prompts that extend them (None: off). Where `count.in_place`, a bounded policy's
    batch keeps its rows in place, in buckets of rows (`Batch.in_place`)."""

    def __init__(self, count: SlotCount, *, kv_memory: int | None, max_batch: int,
                 new_cache: Callable[[Request], KVCache], prefixes: PrefixStore | None = None,
                 new_pass: Callable[[Request, KVCache], Reconstructing] | None = None) -> None:  # fmt: skip
        self.count, self.kv_memory, self.max_batch, self.new_cache = count, kv_memory, max_batch, new_cache
        self.prefixes, self.new_pass = prefixes, new_pass
        self.waiting: deque[Request] = deque()  # submitted, not admitted
        self.prefill: deque[tuple[Request, KVCache]] = deque()  # admitted, prompt going in
        self.passes: dict[Request, Reconstructing] = {}  # those of `prefill` that prefill in a reconstruction pass
        self.batches: dict[Hashable, Batch] = {}  # decoding, by policy (or (policy, request id): `join`)

    @property
    def busy(self) -> bool:
        """Whether an admitted request is in flight (a prompt going in or a batch decoding)."""
        return bool(self.prefill or self.batches)

    def admit(self) -> None:
        """Move waiting requests to the prefill queue while their KV memory fits (FIFO: none overtakes the head), and
        while the head's prefix is not about to be kept (`_prefix_coming`)."""
        while self.waiting and self.running() < self.max_batch:
            request = self.waiting[0]
            room = None if self.kv_memory is None else self.kv_memory - self.projected(request)
            if (room is not None and room < 0) or self._prefix_coming(request):
                return
            self.waiting.popleft()
            self.prefill.append((request, self._start(request, room)))

    def _prefix_coming(self, request: Request) -> bool:
        """Whether a prompt still going in under `request`'s policy is a proper prefix of its prompt and will be kept
        as it stands once through: its first token ended it (a KVzip document asked for one token answers before its
        pass ends, and is kept after it) or its next turn is known (`Request.resend`: `keep_prompt`). The request then
        waits the few steps to start from it rather than prefill the same prefix beside it."""
        if self.prefixes is None:
            return False
        ids = request.prompt_ids
        return any(
            other.policy == request.policy and (other.done or other.resend is not None)
            and other.prompt_tokens < len(ids) and ids[: other.prompt_tokens] == other.prompt_ids
            for other, _ in self.prefill
        )  # fmt: skip

    def prefill_turn(self, chunk: int | None) -> list[tuple[Request, KVCache]]:
        """The prompts that get a chunk this step, in order: the oldest, after the oldest of the others whose prompt
        one call finishes (`calls_left`; None: whole prompts). At most two calls a step, and the oldest prompt
        advances every step, so a stream of short prompts never starves a long one."""
        if not self.prefill:
            return []
        oldest = self.prefill[0]
        short = next((item for item in itertools.islice(self.prefill, 1, None) if self.calls_left(item, chunk) <= 1),
                     None)  # fmt: skip
        return [oldest] if short is None else [short, oldest]

    def calls_left(self, item: tuple[Request, KVCache], chunk: int | None) -> int:
        """Model calls before a prompt going in is through: its chunks of `chunk` tokens left (None: one call), and
        in a reconstruction pass its reconstruction calls left after them (`Reconstructing.pieces_left`)."""
        request, cache = item
        left = request.prompt_tokens - cache.seen_tokens
        chunks = 0 if left <= 0 else 1 if chunk is None else -(-left // chunk)
        job = self.passes.get(request)
        return chunks + (0 if job is None else job.pieces_left)

    def end_prefill(self, item: tuple[Request, KVCache], error: BaseException | None = None) -> None:
        """A prompt is through, or failed (`error`): it leaves the prompts going in, and its reconstruction pass if it
        is in one (ranked, or emptied on error: `Reconstructing.leave`)."""
        self.prefill.remove(item)
        job = self.passes.pop(item[0], None)
        if job is not None:
            job.leave(error)

    def _start(self, request: Request, room: int | None) -> KVCache:
        """An admitted request's cache: a fork of the longest kept prefix of its prompt (the store first shrinking
        to the `room` running requests leave), or a new one."""
        reused = None if self.prefixes is None else self.prefixes.checkout(request.policy, request.prompt_ids, room)
        if reused is not None:
            request.reused_tokens, cache = reused
            return cache
        cache = self.new_cache(request)
        if request.policy.reconstructs and self.new_pass is not None:
            self.passes[request] = self.new_pass(request, cache)
        return cache

    def keep_prompt(self, request: Request, cache: KVCache) -> None:
        """A prompt is through and its request decodes on: with a prefix store and a request that says what its next
        turn will resend (`Request.resend`), keep a copy of its cache as it stands, having seen exactly the prompt.
        Once the answer is known, `keep` leaves the one of the two caches that the next turn can extend."""
        if self.prefixes is not None and request.resend is not None:
            self._put(request, request.prompt_ids, cache.fork)

    def keep(self, request: Request, cache: KVCache, row: int | None = None) -> None:
        """A request ended: with a prefix store, and an answer (not cancelled, no error), keep what its cache has seen
        (prompt and answer but its last token, never fed). `row`: its row of a batch's cache, copied (the batch goes
        on; the copy is the row's slots); None: `cache` is its own and is kept as is. With `Request.resend`, what the
        next turn will start with decides: the prompt and answer's cache if it extends them (the prompt's copy is then
        let go), else the prompt's copy alone (`keep_prompt`: the client's text of the answer tokenizes otherwise, or
        its chat template rewrites the answer, as reasoning models' templates drop the reasoning; or the next request
        extends the prompt without the answer, as questions after a document do). A cache that has seen only the
        prompt (the answer's one token never fed) is kept whatever the next turn. A request cancelled or failed keeps
        nothing more; its prompt's copy stays (a chat client that stopped an answer sends the conversation on with what
        it got). Call `trim` once it has left."""
        if self.prefixes is None or request.finish_reason not in ("stop", "length"):
            return
        seen = request.prompt_ids + request.token_ids[:-1]
        whole = True
        if request.resend is not None and len(seen) > request.prompt_tokens:
            try:
                resent = list(request.resend(request.text))
            except Exception:  # the answer is served; only the choice of what to keep is lost
                log.exception("%s: what its next turn resends is unknown: its whole cache is kept", request.id)
                resent = seen
            whole = resent[: len(seen)] == seen
            if whole:
                self.prefixes.discard(request.policy, request.prompt_ids)  # `keep_prompt`'s copy: not needed
        if whole:
            self._put(request, seen, (lambda: cache) if row is None else (lambda: cache.fork([row])))

    def _put(self, request: Request, ids: list[int], copy: Callable[[], KVCache]) -> None:
        """Keep `copy()`, a cache that has seen `ids`, unless there is no memory for the copy."""

        def wanted() -> frozenset:  # what waiting requests will start from: none dropped for this one (if any must go)
            waiting = tuple(self.waiting)  # one copy in C: `submit` may append meanwhile (it holds only the queue lock)
            return self.prefixes.wanted_by((r.policy, r.prompt_ids) for r in waiting)

        try:
            self.prefixes.put(request.policy, ids, copy(), wanted)
        except (torch.OutOfMemoryError, MemoryError):  # no room for the copy: a later prefill, not a failed engine
            log.warning("%s: its cache was not kept for reuse: out of memory for the copy", request.id)

    def trim(self) -> None:
        """Drop kept caches until they fit in what the running requests leave of `kv_memory`."""
        if self.prefixes is not None and self.kv_memory is not None:
            self.prefixes.evict(max(0, self.kv_memory - self.projected()))

    def take_cancelled(self) -> list[Request]:
        """Remove every cancelled request from its stage (a decoding one records what it held; one in a reconstruction
        pass leaves it, emptied) and return them. A request its first token ended finishes its pass."""
        gone = [r for r in self.waiting if r.cancelled]
        for request in gone:
            self.waiting.remove(request)
        for item in [item for item in self.prefill if item[0].cancelled and not item[0].done]:
            self.end_prefill(item, RuntimeError("cancelled"))
            gone.append(item[0])
        for policy, batch in list(self.batches.items()):
            rows = [i for i, r in enumerate(batch.requests) if r.cancelled]
            for i in rows:
                batch.record(i)  # what it held when it stopped
                gone.append(batch.requests[i])
            if rows:
                self.leave(policy, rows)
        return gone

    def join(self, request: Request, cache: KVCache, device) -> None:
        """A request whose prompt is through (first token sampled) joins its policy's batch. One whose layers its pass
        sized apart (a policy ranking the whole cache: KVzip's own allocation) joins it where the batch, each layer as
        wide as its widest row's, still fits `kv_memory` beside everyone else (`projected`); else it decodes in a
        batch of its own, its layers the sizes its pass gave them, which is what admission counted."""
        key = request.policy
        if ranks_whole_cache(request.policy) and not cache.layers_alike() and not self._fits_joined(request, cache):
            key = (request.policy, request.id)
        batch = self.batches.get(key)
        coming = self._going_in(key)
        width = self._widest([request, *coming] if request.policy == key else coming)
        tight = self._tight(joined=request)
        if batch is None:
            rows = self.max_batch if self.count.in_place else None
            self.batches[key] = Batch(request, cache, device, rows, coming=len(coming), width=width, tight=tight)
        else:
            batch.join(request, cache, width=width, coming=len(coming), tight=tight)

    def leave(self, key: Hashable, rows: list[int]) -> None:
        """Rows of a batch (its key in `batches`) are done: free them, and the batch once empty."""
        batch = self.batches[key]
        if len(rows) == len(batch):
            del self.batches[key]
        else:
            coming = self._going_in(key)
            gone = {id(batch.requests[i]) for i in rows}
            tight = self._tight(gone=gone)
            batch.leave(rows, coming=len(coming), width=self._widest(coming), tight=tight)
        self.trim()

    def _going_in(self, key: Hashable) -> list[Request]:
        """Prompts going in under the policy of batch `key`: they join it once through (`Batch`'s buckets count them;
        a batch of its own, keyed (policy, request id), has none)."""
        return [request for request, _ in self.prefill if request.policy == key]

    def _widest(self, requests: list[Request]) -> int:
        """Slots per row the widest of `requests` will decode in (`SlotCount.slots`, what admission counted); 0 for
        none, or rows packed."""
        if not requests or not self.count.in_place:
            return 0
        return max(self.count.slots(r.policy, r.prompt_tokens, r.max_tokens)[0] for r in requests)

    def running(self) -> int:
        return len(self.prefill) + sum(len(batch) for batch in self.batches.values())

    def all_running(self) -> list[Request]:
        return [r for r, _ in self.prefill] + [r for batch in self.batches.values() for r in batch.requests]

    def all_requests(self) -> list[Request]:
        return list(self.waiting) + self.all_running()

    def kv_bytes_in_use(self) -> int:
        caches = [batch.cache for batch in self.batches.values()] + [cache for _, cache in self.prefill]
        return sum(cache.nbytes() for cache in caches)

    def projected(self, extra: Request | None = None, joining: tuple[Request, int] | None = None) -> int:
        """KV bytes if `extra` were admitted (None: of those running): every batch at its widest row (prompts still
        going in counted in their batch), plus the two largest prompts in flight (a step feeds at most two:
        `prefill_turn`). A batch in place counts what it allocates: its bucket of rows (free rows too), each as wide
        as its widest; where the power-of-two buckets would pass `kv_memory`, the tight ones (`_tight`). A policy's
        batches count no less than they hold (whole-cache rows: each layer as wide as its widest row's). `joining`: a
        request whose prompt is through and the bytes its policy's batch would hold with it (`join`)."""
        total = self._bytes(extra, joining)
        if self.kv_memory is not None and total > self.kv_memory:
            total = self._bytes(extra, joining, tight=True)
        return total

    def _tight(self, joined: Request | None = None, gone: set[int] = frozenset()) -> bool:
        """Whether batches in place take tight buckets (just the rows in use, `batch.bucket`): the power-of-two
        buckets of those running (with `joined`, a request whose prompt is through, and without the requests whose
        ids are in `gone`) would pass `kv_memory`. Admission projected the same (`projected`), so a batch never
        allocates more than admission counted."""
        return self.kv_memory is not None and self._bytes(joined=joined, gone=gone) > self.kv_memory

    def _bytes(self, extra: Request | None = None, joining: tuple[Request, int] | None = None, tight: bool = False,
               joined: Request | None = None, gone: set[int] = frozenset()) -> int:  # fmt: skip
        """`projected` with power-of-two buckets, or with `tight` ones; `joined` counts as decoding, the requests in
        `gone` not at all (`_tight`)."""
        groups: dict[Policy, list[int]] = {}
        prefill = [0, 0]
        running = [*self.all_running(), *([extra] if extra is not None else [])]
        running += [joining[0]] if joining is not None else []
        running += [joined] if joined is not None else []
        for request in [r for r in running if id(r) not in gone]:
            decode, prompt = self.count.slots(request.policy, request.prompt_tokens, request.max_tokens)
            groups.setdefault(request.policy, []).append(decode)
            if request is extra or any(request is r for r, _ in self.prefill):
                prefill = sorted([*prefill, prompt])[1:]
        total = sum(prefill) * self.count.layout
        for policy, widths in groups.items():
            held = self._held(policy, joining)
            if not self.count.in_place or not self.count.bounded(policy):
                total += max(len(widths) * max(widths) * self.count.layout, held)
                continue
            rows, row_bytes = bucket(len(widths), self.max_batch, tight), max(widths) * self.count.layout
            batch = self.batches.get(policy)
            if batch is not None:  # its rows as wide as the widest that joined, and no fewer than it holds now
                size = batch.cache.batch_size
                rows, row_bytes = max(rows, size), max(row_bytes, batch.cache.nbytes() // size)
            total += max(rows * row_bytes, held)
        return total

    def _held(self, policy: Policy, joining: tuple[Request, int] | None) -> int:
        """Bytes the batches of `policy` hold (its own batch as `joining` says it would, with that request)."""
        held = sum(batch.cache.nbytes() for batch in self.batches.values() if batch.requests[0].policy == policy)
        if joining is not None and joining[0].policy == policy:
            batch = self.batches.get(policy)
            held += joining[1] - (0 if batch is None else batch.cache.nbytes())
        return held

    def _fits_joined(self, request: Request, cache: KVCache) -> bool:
        """Whether `request` (its prompt through `cache`) can join its policy's batch within `kv_memory`."""
        batch = self.batches.get(request.policy)
        if batch is None:
            return True  # it starts the batch: it holds what its pass left it, as admitted
        if self.kv_memory is None:
            return True
        rows = batch.rows_after_join(len(self._going_in(request.policy)), self._tight(joined=request))
        after = batch.cache.joined_nbytes(cache, rows, in_place=batch.in_place)
        return self.projected(joining=(request, after)) <= self.kv_memory

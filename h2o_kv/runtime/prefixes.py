"""Automatic prefix reuse: finished requests' bounded caches, kept by the token ids they have seen, in a byte budget.

When a request ends with its answer (`stop` or `length`), its cache has seen the prompt and every generated token but
the last (sampled, never fed). `PrefixStore.put` keeps that cache under (policy, those ids). A later request whose
prompt extends a kept sequence (the kept ids are a proper prefix of its prompt, under the same policy object) starts
from a fork of it (`checkout`: `KVCache.fork()`, the kept entry stays for the next one) and prefills only the new
tokens. The reused cache is exactly the one cache that was fed the first prompt, its answer and then the extension:
its capacity is the kept cache's (a fraction budget stays sized by the first prompt), as one cache fed the same calls
in one run would have it. With `Full()` that is a fresh prefill's cache.

The store holds at most `budget` bytes (`KVCache.nbytes()` of its caches), least recently used out first, except
that a cache kept for a request still waiting for admission is not dropped to keep another (a conversation's next
turn queued behind long prefills would otherwise find its prefix gone); the scheduler also drops kept caches, those
too, whenever running requests need the room (`evict`), so kept bytes never make a request wait. Everything here
runs on the engine's thread, under its step lock.

For the cluster's router (`runtime/cluster/affinity.py`) the store also publishes `kept`: the (length, fingerprint)
of each kept sequence, most recently used first, as one immutable tuple replaced after every change, so another
thread (the replica's routing-stats report) reads a consistent snapshot without the step lock. A fingerprint is a
chain of 64-bit BLAKE2b digests over the token ids in blocks of `BLOCK` (`fingerprint`); a router that has a
request's prompt ids computes the fingerprint of any prefix of them from the prompt's own chain (`chain`, `link`)
with at most one more digest, and so learns which kept sequence the prompt extends on each replica.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import Policy

Key = tuple[Policy, tuple[int, ...]]
BLOCK = 32  # token ids hashed together in a fingerprint's chain
KEPT_REPORTED = 1024  # most kept sequences in `kept` (the most recently used)


def pack(ids) -> bytes:
    """Token ids as little-endian unsigned 32-bit numbers: what fingerprints hash (the same bytes on every machine)."""
    return struct.pack(f"<{len(ids)}I", *ids)


def link(digest: int, data: bytes) -> int:
    """The next digest of a chain: BLAKE2b (64 bits) of the previous one and the packed ids that follow."""
    return int.from_bytes(hashlib.blake2b(digest.to_bytes(8, "little") + data, digest_size=8).digest(), "little")


def chain(packed: bytes) -> list[int]:
    """Digests of the first 0, 1, 2, ... full blocks of packed ids (0 for none)."""
    step = 4 * BLOCK
    digests = [0]
    for start in range(0, len(packed) - step + 1, step):
        digests.append(link(digests[-1], packed[start : start + step]))
    return digests


def fingerprint(ids) -> int:
    """The fingerprint of a token sequence: its full blocks chained, then the rest (if any) linked to the last."""
    packed = pack(ids)
    digests = chain(packed)
    tail = packed[4 * BLOCK * (len(digests) - 1) :]
    return link(digests[-1], tail) if tail else digests[-1]


class PrefixStore:
    """Kept caches by (policy, token ids seen), least recently used first; at most `budget` bytes held."""

    def __init__(self, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"a prefix store's budget must be a positive number of bytes, got {budget!r}")
        self.budget = budget
        self._entries: OrderedDict[Key, tuple[KVCache, int, int]] = OrderedDict()  # (cache, bytes, fingerprint)
        self.kept: tuple[tuple[int, int], ...] = ()  # (length, fingerprint) of the kept sequences, newest use first
        self.held = 0  # bytes of the kept caches
        self.peak = 0  # most bytes held at once
        self.hits = 0  # requests that started from a kept cache
        self.tokens_reused = 0  # prompt tokens those requests did not prefill
        self.dropped = 0  # kept caches let go for room

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, policy: Policy, ids: list[int], cache: KVCache,
            wanted: Callable[[], frozenset[Key]] = frozenset) -> None:  # fmt: skip
        """Keep `cache`, which has seen exactly `ids` under `policy` (the store owns it now); the least recently used
        go while the store is over its budget, but not those `wanted()` gives (the kept sequences waiting requests
        will start from: `wanted_by`; asked only when something must go). A cache that would not fit otherwise is
        not kept."""
        if cache.seen_tokens != len(ids):
            raise ValueError(f"the cache has seen {cache.seen_tokens} tokens, not the {len(ids)} it is kept under")
        key = (policy, tuple(ids))
        self._remove(key)
        size = cache.nbytes()
        if size > self.budget:  # nothing is dropped for it
            self._publish()
            return
        if self.held + size > self.budget:
            self.evict(self.budget - size, spare=wanted())
        if self.held + size > self.budget:  # only wanted caches were left to drop
            self._publish()
            return
        self._entries[key] = (cache, size, fingerprint(ids))
        self.held += size
        self.peak = max(self.peak, self.held)
        self._publish()

    def longest(self, policy: Policy, ids: list[int]) -> Key | None:
        """The key of the longest kept sequence under `policy` that is a proper prefix of `ids` (None: none is),
        marked as just used."""
        best = self._longest(policy, tuple(ids))
        if best is not None:
            self._entries.move_to_end(best)
        return best

    def discard(self, policy: Policy, ids: list[int]) -> None:
        """Let go of the cache kept under (policy, ids), if there is one."""
        if (policy, tuple(ids)) in self._entries:
            self._remove((policy, tuple(ids)))
            self._publish()

    def wanted_by(self, prompts) -> frozenset[Key]:
        """The kept sequences that the (policy, prompt ids) of `prompts` would start from (their use unmarked)."""
        return frozenset(key for policy, ids in prompts if (key := self._longest(policy, tuple(ids))) is not None)

    def _longest(self, policy: Policy, ids: tuple[int, ...]) -> Key | None:
        best = None
        for key in self._entries:
            mine, seen = key
            if mine == policy and len(seen) < len(ids) and (best is None or len(seen) > len(best[1])):
                if ids[: len(seen)] == seen:
                    best = key
        return best

    def checkout(self, policy: Policy, ids: list[int], room: int | None = None) -> tuple[int, KVCache] | None:
        """A prompt starts: (tokens reused, a fork of the longest kept prefix of `ids` under `policy`), or None.
        First the store shrinks to `room` bytes (what running requests leave), the prefix wanted kept last."""
        key = self.longest(policy, ids)
        if room is not None:
            self.evict(room)
        if key is None or key not in self._entries:
            return None
        self._publish()  # the prefix used is the newest now
        self.hits += 1
        self.tokens_reused += len(key[1])
        return len(key[1]), self._entries[key][0].fork()

    def evict(self, limit: int, spare: frozenset[Key] = frozenset()) -> None:
        """Drop the least recently used kept caches until at most `limit` bytes are held, none of `spare`."""
        dropped = self.dropped
        for key in [key for key in self._entries if key not in spare]:
            if self.held <= limit:
                break
            self._remove(key)
            self.dropped += 1
        if self.dropped != dropped:
            self._publish()

    def _publish(self) -> None:
        """Replace `kept` with the (length, fingerprint) of the `KEPT_REPORTED` most recently used sequences."""
        newest = islice(reversed(self._entries.items()), KEPT_REPORTED)
        self.kept = tuple((len(ids), entry[2]) for (_, ids), entry in newest)

    def _remove(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.held -= entry[1]

    NONE = {"prefix_hits": 0, "prefix_tokens_reused": 0, "prefix_bytes_held": 0, "prefix_bytes_peak": 0,
            "prefix_entries": 0, "prefix_dropped": 0}  # fmt: skip  # an engine without a store

    def stats(self) -> dict:
        return {
            "prefix_hits": self.hits,
            "prefix_tokens_reused": self.tokens_reused,
            "prefix_bytes_held": self.held,
            "prefix_bytes_peak": self.peak,
            "prefix_entries": len(self._entries),
            "prefix_dropped": self.dropped,
        }

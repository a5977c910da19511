"""Which replica should take a request: the choice rule of the cluster's router, as pure functions (no Ray).

Each replica's prefix store (`runtime/prefixes.py`, `serve --session-memory`) keeps finished requests' caches; a
request whose prompt ids extend a kept sequence starts from it and prefills only the rest. Bounded caches cannot
be cut back to a shorter prefix (evicted tokens are gone), so a kept sequence is worth the whole of it or nothing:
what a replica can reuse for a prompt is the longest kept sequence that is a proper prefix of the prompt's ids.

So each replica reports one (length, fingerprint) per kept sequence (`PrefixStore.kept`), and the gateway, which
tokenizes the request as the replica's app will (`prompts.py`), sends the prompt's own chain of block digests
(`Prompt`). From them the router finds, per replica, the longest kept sequence the prompt extends (`reused`):
one dictionary lookup per length reported and at most one more digest per length. A fingerprint is 64 bits:
a collision could only mislead the routing, never an answer (the replica's store compares the ids themselves).

The cost (`cost`, smaller first) of sending a request of `n` prompt tokens to a replica:

1. **Room first**: a replica with room for the request (free KV bytes, after the requests sent to it since its
   last report, at least the expected reservation of one request) before one where it would wait.
2. **Then prefill against fill**: `(n - reused) + max(n, 1) * fill`, in tokens. `reused`: the prompt tokens the
   replica holds (its prefill saved); `fill`: the share of its KV memory reserved (0 empty, 1 full), or without a
   KV limit the share of its batch slots taken. A full replica costs one whole prefill more than an empty one, so
   a kept prefix wins where it saves more of the prompt than the replica is fuller than the others: with equal
   room any reuse wins, and a small match loses to a much emptier replica.
3. **Then** more free KV bytes, then fewer requests (waiting, running and sent since the report).

A replica that has not reported yet (just started) counts as empty, holding nothing. A replica whose last report is
older than `STALE_S` (each reports at least every `BEAT_S`, even idle) holds nothing for this rule: it may be stuck,
and its kept prefixes must not pull conversations to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from h2o_kv.runtime.prefixes import BLOCK, chain, link, pack

BEAT_S = 5.0  # a replica's report changes at least this often, so the router hears from an idle one too
STALE_S = 30.0  # a report older than this: the replica's kept prefixes are not counted


@dataclass
class Prompt:
    """A request's prompt token ids as the router needs them: their count, the ids packed, and the chain of
    digests of its full blocks (computed once, in the gateway); `at(length)` is the fingerprint of a prefix."""

    length: int
    id_bytes: bytes
    digests: list[int]
    memo: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, ids: list[int]) -> Prompt:
        packed = pack(ids)
        return cls(len(ids), packed, chain(packed))

    def __reduce__(self):  # the memo stays behind: the call carries the prompt on to the replica
        return Prompt, (self.length, self.id_bytes, self.digests)

    def at(self, length: int) -> int:
        """The fingerprint of the first `length` ids (`prefixes.fingerprint` of them), from the chain."""
        if length not in self.memo:
            blocks = length // BLOCK
            tail = self.id_bytes[4 * BLOCK * blocks : 4 * length]
            self.memo[length] = link(self.digests[blocks], tail) if tail else self.digests[blocks]
        return self.memo[length]


class Kept:
    """A replica's reported kept sequences, indexed: fingerprints by length, the lengths longest first."""

    def __init__(self, reported) -> None:
        self.by_length: dict[int, set[int]] = {}
        for length, fingerprint in reported or ():
            self.by_length.setdefault(int(length), set()).add(int(fingerprint))
        self.lengths = sorted(self.by_length, reverse=True)


def reused(prompt: Prompt | None, kept: Kept | None) -> int:
    """Prompt tokens the replica would not prefill: the length of its longest kept sequence that is a proper
    prefix of the prompt (the store reuses nothing else), 0 for none."""
    if prompt is None or kept is None:
        return 0
    for length in kept.lengths:
        if length < prompt.length and prompt.at(length) in kept.by_length[length]:
            return length
    return 0


@dataclass(frozen=True)
class Replica:
    """What the router knows of one replica, for one request."""

    free: float = math.inf  # KV bytes free for new reservations, less the requests sent since its report
    allowed: float = math.inf  # its KV memory (inf: no limit)
    requests: int = 0  # waiting, running and sent since its report
    slots: int = 0  # most requests it runs at once (0: unknown)
    reused: int = 0  # prompt tokens its longest kept prefix of the request covers

    def fill(self) -> float:
        """How full it is, 0 to 1: the share of its KV memory reserved, or without a limit of its batch slots."""
        if math.isfinite(self.allowed) and self.allowed > 0:
            return min(1.0, max(0.0, 1.0 - self.free / self.allowed))
        return min(1.0, self.requests / self.slots) if self.slots else 0.0


def cost(replica: Replica, prompt_tokens: int, need: float) -> tuple[bool, float, float, int]:
    """A replica's cost for a request of `prompt_tokens` expected to reserve `need` bytes, smaller first: no room,
    then prefill left plus fill weighed as one prompt's prefill, then less free memory, then more requests."""
    prefill = max(0, prompt_tokens - replica.reused) + max(prompt_tokens, 1) * replica.fill()
    return replica.free < need, prefill, -replica.free, replica.requests


def order(replicas: list[Replica], prompt_tokens: int, need: float) -> list[int]:
    """The replicas' indices, best first (ties keep the given order)."""
    return sorted(range(len(replicas)), key=lambda i: cost(replicas[i], prompt_tokens, need))

"""One generation request as the engine sees it: its settings, its tokens, its text and its events.

The engine thread appends tokens (`push`) and finishes requests (`finish`); callers read events
(`events()`, or an `on_event` callback) and the final `result()` from any thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from h2o_kv.policies import Policy
from h2o_kv.runtime.detokenize import Detokenizer
from h2o_kv.runtime.generation import Sampling

_ids = itertools.count(1)


@dataclass(frozen=True)
class Event:
    """New text of one request since its last event; the last event carries `finish_reason`."""

    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass(eq=False)
class Request:
    """A submitted prompt. `cancel()` and the readers are thread-safe."""

    prompt_ids: list[int]
    policy: Policy
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    kv_bytes: int  # admission size
    decode: Callable[[list[int]], str]
    on_event: Callable[[Event], None] | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
    cache_stats: dict = field(default_factory=dict)  # kept/seen tokens and KV bytes at the end
    kv_inspect: bool = False  # cache_stats also holds the kept map's summary ("kept_map": `KeptMap.summary`)
    reused_tokens: int = 0  # prompt tokens a kept cache had seen (not prefilled; runtime/prefixes.py)
    resend: Callable[[str], list[int]] | None = None  # the ids a next turn starts with, given this answer's text
    _text: str = ""  # text emitted so far
    _detokenizer: Detokenizer | None = None  # the text after each token, decoding only the newest (detokenize.py)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)
    _recorded: threading.Event = field(default_factory=threading.Event)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def position(self) -> int:
        """Absolute position of the next token fed to the model (the last sampled one)."""
        return len(self.prompt_ids) + len(self.token_ids) - 1

    @property
    def text(self) -> str:
        """The answer's text as emitted so far (what the client got: cut before a stop string, EOS not spelt)."""
        return self._text

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; the engine frees this request's rows at its next step."""
        self._cancelled.set()

    # -- engine side ----------------------------------------------------------------------------------
    def push(self, token: int, eos: bool) -> bool:
        """Record a sampled token; emit its text. Returns True when the request is finished."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids.append(token)
        if eos or len(self.token_ids) >= self.max_tokens:  # the last event's text: one whole decode
            text = self.decode(self.token_ids[:-1] if eos else self.token_ids)
        else:
            if self._detokenizer is None:
                self._detokenizer = Detokenizer(self.decode)
            text = self._detokenizer.text(self.token_ids)
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self._emit(token, text[:hit], "stop")
        elif eos:
            self._emit(token, text, "stop")
        elif len(self.token_ids) >= self.max_tokens:
            self._emit(token, text, "length")
        else:
            self._emit(token, text[: len(text) - self._held_back(text)], None)
        return self.finish_reason is not None

    def note_stats(self, stats: dict) -> None:
        """What the request's cache held at its end (the engine records it just after the last token's event)."""
        self.cache_stats = stats
        self._recorded.set()

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the request without a new token (cancelled, or an error)."""
        if self.finish_reason is None:
            self.error = error
            self._emit(None, self._text, reason)

    def _held_back(self, text: str) -> int:
        """Characters not to emit yet: an incomplete UTF-8 character, or the start of a stop string."""
        hold = 1 if text.endswith("\ufffd") else 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def _emit(self, token: int | None, text: str, reason: str | None) -> None:
        if not text.startswith(self._text):  # a decode that changed earlier text: only send what is new
            text = self._text + text[len(self._text) :]
        delta, self._text = text[len(self._text) :], text
        if reason is not None:
            self.finish_reason = reason
        event = Event(token, delta, reason)
        self._queue.put(event)
        if self.on_event is not None:
            self.on_event(event)
        if reason is not None:
            self._done.set()

    # -- caller side -----------------------------------------------------------------------------------
    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events as they are decoded, ending with the one that carries `finish_reason`."""
        while True:
            try:
                event = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.id}: no event within {timeout} s") from None
            yield event
            if event.finish_reason is not None:
                return

    def stats(self, timeout: float | None = None) -> dict:
        """`cache_stats` once the engine has recorded them, which it does for a request that ends with its answer
        ("stop" or "length") just after the last event; {} if not within `timeout`."""
        return self.cache_stats if self._recorded.wait(timeout) else {}

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the end and return the whole completion (raises RuntimeError if generation failed)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.id}: not finished within {timeout} s")
        if self.finish_reason == "error":
            raise RuntimeError(f"{self.id} failed: {self.error}")
        return Completion(
            token_ids=list(self.token_ids),
            text=self._text,
            finish_reason=self.finish_reason or "",
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.token_ids),
            error=self.error,
        )

"""The generation engine: continuous batching over bounded KV caches, admitted by KV memory.

    engine = Engine(model, tokenizer, policy="h2o", budget=0.2, kv_memory=2**30)
    request = engine.submit(prompt_ids, max_tokens=64)
    engine.run()                      # or engine.start() for a background thread
    print(request.result().text)

One iteration (`step`): admit waiting requests whose KV fits in `kv_memory` (FIFO), run one
prefill chunk of the oldest admitted prompt (so running streams keep flowing while a long prompt
joins), after one of a prompt that a chunk finishes (a short prompt never waits behind long ones),
then one decode step for every running sequence. A prefilled request joins the running
batch of its policy (requests with the same policy and budget share one `KVCache` and one forward
call); a finished or cancelled request leaves it and its rows are freed. A KVzip request prefills inside its
reconstruction pass, one call per step (reconstructing.py), then joins.

This file is the public API and the thread; who runs when is `scheduler.py` (admission: `admission.py`), one
policy's rows are `batch.py`, and the model calls are `steps.py`. docs/internals.md follows a request through them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from h2o_kv import backends, policies
from h2o_kv.cache.attention import enable
from h2o_kv.cache.formats import check_kv_dtype
from h2o_kv.cache.kvcache import KVCache, check_headroom
from h2o_kv.model_config import text_config
from h2o_kv.policies import Policy
from h2o_kv.runtime.admission import SlotCount, admission_bytes
from h2o_kv.runtime.captured import CapturedSteps
from h2o_kv.runtime.compress import piece_overhead
from h2o_kv.runtime.detokenize import decoder
from h2o_kv.runtime.generation import Sampling, eos_ids
from h2o_kv.runtime.prefixes import PrefixStore
from h2o_kv.runtime.reconstructing import Reconstructing
from h2o_kv.runtime.request import Completion, Event, Request
from h2o_kv.runtime.scheduler import Scheduler
from h2o_kv.runtime.steps import EagerSteps

__all__ = ["Engine", "Request", "Event", "Completion", "Sampling"]


DEFAULT_BUDGET = 0.2  # a fifth of the prompt: the committed studies' operating point


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        policy: str = policies.DEFAULT,
        budget: policies.Budget = DEFAULT_BUDGET,
        kv_memory: int | None = None,
        max_batch: int = 16,
        prefill_chunk: int | None = 256,
        sinks: int = 4,
        mode: str = "drop",
        kv_dtype: str | None = None,
        session_memory: int | None = None,
        rows_in_place: bool | None = None,
        captured_steps: bool | None = None,
        headroom: int = 0,
    ) -> None:
        """`rows_in_place`: each policy's batch keeps its rows in place, in buckets (batch.py), so a join or a leave
        copies no other row's storage; `captured_steps`: a batch's steady decode step is recorded as a CUDA graph
        once per bucket and replayed (captured.py). None: both on a GPU, both off on a CPU. `headroom`: tokens each
        (sequence, KV head) of a bounded cache holds past its budget once its prompt is through (`KVCache`'s): with
        `session_memory`, a question after a kept document joins it without evicting any of it; admission counts it."""
        # the defaults must make sense; a Full default keeps `budget` for requests naming a bounded policy
        policies.build(policy, None if str(policy).lower() == "full" else budget, sinks=sinks)
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_headroom(headroom)
        if kv_memory is not None and (isinstance(kv_memory, bool) or not isinstance(kv_memory, int) or kv_memory < 1):
            raise ValueError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
        if session_memory is not None and (isinstance(session_memory, bool) or not isinstance(session_memory, int)
                                           or session_memory < 0):  # fmt: skip
            raise ValueError(f"session_memory must be a number of bytes (0: off), got {session_memory!r}")
        self.model, self.tokenizer = enable(model), tokenizer
        self._detokenize = decoder(tokenizer)  # tokenizer.decode(ids, skip_special_tokens=True), the shortest route
        check_kv_dtype(kv_dtype)
        backends.prepare(model.device)  # the C++ kernels built (once per machine) before the first request's step
        self.policy, self.budget, self.sinks, self.mode, self.kv_dtype = policy, budget, sinks, mode, kv_dtype
        self.kv_memory, self.max_batch, self.prefill_chunk = kv_memory, max_batch, prefill_chunk
        config = text_config(model.config)
        self.context_limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.rows_in_place = model.device.type == "cuda" if rows_in_place is None else bool(rows_in_place)
        self.headroom = headroom
        self._count = SlotCount(config, model.dtype, kv_dtype, mode, prefill_chunk, in_place=self.rows_in_place,
                                pass_extra=lambda: piece_overhead(tokenizer), headroom=headroom)  # fmt: skip
        self._lock = threading.Condition()  # guards the waiting queue (submit never waits for a step)
        self._state = threading.Lock()  # held by a step while it changes the batches; stats() reads under it
        self.session_memory = session_memory or None
        self.prefixes = PrefixStore(session_memory) if session_memory else None  # kept caches, for reuse
        self._runs = Scheduler(self._count, kv_memory=kv_memory, max_batch=max_batch, new_cache=self._new_cache,
                               prefixes=self.prefixes, new_pass=self._new_pass)  # fmt: skip
        self.eos = eos_ids(model, tokenizer)
        cuda = model.device.type == "cuda"
        if captured_steps and not cuda:
            raise ValueError(f"captured steps are CUDA graphs: they need a model on a GPU, not {model.device}")
        steps = CapturedSteps if (cuda if captured_steps is None else captured_steps) else EagerSteps
        self._steps = steps(model, eos=self.eos, prefill_chunk=prefill_chunk, held=self._note_peaks)
        self._thread: threading.Thread | None = None
        self._closing = False
        self.peaks = {"running": 0, "kv_bytes_in_use": 0}  # high-water marks since start or reset_peaks()

    # -- the public API ----------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int = 128,
        sampling: Sampling | None = None,
        stop: str | list[str] | tuple[str, ...] = (),
        policy: str | Policy | None = None,
        budget: policies.Budget = None,
        ignore_eos: bool = False,
        on_event=None,
        kv_inspect: bool = False,
        resend: Callable[[str], list[int]] | None = None,
    ) -> Request:
        """Queue a prompt (token ids); raises at once for anything that cannot be served: `h2o_kv.errors`'
        ContextTooLong, KVMemoryExceeded, UnknownPolicy, BadBudget (each a ValueError naming its `param`).
        `resend(answer_text)`: the token ids a next turn will start with (the conversation as a client sends it back
        with this answer), so that with `session_memory` the cache kept is one that turn extends (scheduler.py's
        `keep`); without it the cache that has seen the prompt and the answer's tokens is kept."""
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("the prompt is empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be non-empty strings")
        built = self.resolve_policy(policy, budget)
        kv_bytes = admission_bytes(self._count, built, len(prompt_ids), max_tokens, context=self.context_limit,
                                   kv_memory=self.kv_memory)  # fmt: skip
        sampling = sampling or Sampling()
        request = Request(
            list(prompt_ids), built, max_tokens, sampling, stop, kv_bytes, self._detokenize, on_event=on_event
        )
        request.generator = sampling.generator(self.model.device)
        request.ignore_eos = bool(ignore_eos)
        request.resend = resend
        request.kv_inspect = bool(kv_inspect)  # its kept map recorded at its end: `request.stats()["kept_map"]`
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self._runs.waiting.append(request)
            self._lock.notify_all()
        return request

    def generate(self, prompt_ids: list[int], **kwargs) -> Completion:
        """Submit one prompt and run it to the end on this thread (no background thread needed)."""
        request = self.submit(prompt_ids, **kwargs)
        if self._thread is None:
            self.run()
        return request.result()

    def resolve_policy(self, policy: str | Policy | None = None, budget: policies.Budget = None) -> Policy:
        """A request's policy: the engine's defaults, overridden by the request's name and budget
        (or a Policy object as is)."""
        if isinstance(policy, Policy):
            if budget is not None:
                raise ValueError("give a budget with a policy name, not with a Policy object")
            built = policy
        else:
            name = policy or self.policy
            if budget is None and str(name).lower() != "full":
                budget = self.budget  # None: a request naming a bounded policy must then give its own
            built = policies.build(name, budget, sinks=self.sinks)
        return built

    def kv_bytes_for(self, prompt_len: int, max_tokens: int, policy: Policy | None = None) -> int:
        """Most KV bytes a request can hold while decoding (its admission size)."""
        return self._count.bytes(policy or self.resolve_policy(), prompt_len, max_tokens)

    def stats(self) -> dict:
        with self._state, self._lock:
            return {
                "running": self._runs.running(),
                "waiting": self.waiting(),  # the queue's lock is reentrant (a Condition's RLock)
                "kv_bytes_in_use": self.kv_bytes_in_use(),
                "kv_bytes_reserved": self._runs.projected(),
                "kv_bytes_allowed": self.kv_memory,
                "running_peak": self.peaks["running"],
                "kv_bytes_peak": self.peaks["kv_bytes_in_use"],
                "generated_tokens": self._steps.generated_tokens,
                "finished_requests": self._steps.finished_requests,
                "session_memory": self.session_memory,
                **(PrefixStore.NONE if self.prefixes is None else self.prefixes.stats()),
            }

    def waiting(self) -> int:
        """Requests submitted and not admitted yet. Reads the queue alone, so it never waits for a step (the
        server's queue limit asks on its event loop)."""
        with self._lock:
            return len(self._runs.waiting)

    def kv_bytes_in_use(self) -> int:
        return self._runs.kv_bytes_in_use()

    def reset_peaks(self) -> None:
        """Start the high-water marks of `stats()` again from what is held now (a load test per config)."""
        with self._state, self._lock:
            self.peaks = {"running": 0, "kv_bytes_in_use": 0}
            self._note_peaks()

    def _note_peaks(self, kv_bytes: bool = True) -> None:
        """Called where a step holds most: after admission (requests; the new caches are still empty) and
        after each forward (requests and KV bytes), before anyone leaves."""
        self.peaks["running"] = max(self.peaks["running"], self._runs.running())
        if kv_bytes:
            self.peaks["kv_bytes_in_use"] = max(self.peaks["kv_bytes_in_use"], self.kv_bytes_in_use())

    def run(self) -> None:
        """Step until no request is left."""
        while self.step():
            pass

    def start(self) -> None:
        """Run the engine loop in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="h2o-kv-engine", daemon=True)
            self._thread.start()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish the admitted ones (drain) or cancel everything."""
        with self._lock:
            self._closing = True
            if not drain:
                for request in self._runs.all_requests():
                    request.cancel()
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine did not finish its requests within {timeout} s")
            self._thread = None
        else:
            self.run()

    # -- one iteration -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Admit, one or two prefill chunks, one decode step. Returns False when there was nothing to do."""
        with self._state:
            return self._step()

    def _step(self) -> bool:
        runs = self._runs
        with self._lock:
            for request in runs.take_cancelled():
                self._steps.finish(request, "cancelled")
            runs.admit()
            self._note_peaks(kv_bytes=False)
            work = runs.busy
        if runs.prefill:
            self._steps.prefill(runs)
        for policy in list(runs.batches):
            self._steps.decode(runs, policy)
        return work or bool(runs.waiting)

    def _loop(self) -> None:
        while True:
            with self._lock:
                idle = not (self._runs.waiting or self._runs.busy)
                if idle and self._closing:
                    return
                if idle:
                    self._lock.wait(timeout=0.5)
                    continue
            self.step()

    def _new_cache(self, request: Request) -> KVCache:
        return KVCache(request.policy, mode=self.mode, prompt_len=request.prompt_tokens, kv_dtype=self.kv_dtype,
                       headroom=self.headroom)  # fmt: skip

    def _new_pass(self, request: Request, cache: KVCache) -> Reconstructing:
        return Reconstructing(cache, request.prompt_ids, self.tokenizer, self.prefill_chunk, self.model.device)

"""The generation engine: continuous batching over bounded KV caches, admitted by KV memory.

    engine = Engine(model, tokenizer, policy="h2o", budget=0.2, kv_memory=2**30)
    request = engine.submit(prompt_ids, max_tokens=64)
    engine.run()                      # or engine.start() for a background thread
    print(request.result().text)

One iteration (`step`): admit waiting requests whose KV fits in `kv_memory` (FIFO), run one
prefill chunk of the oldest admitted prompt (so running streams keep flowing while a long prompt
joins), then one decode step for every running sequence. A prefilled request joins the running
batch of its policy (requests with the same policy and budget share one `KVCache` and one forward
call); a finished or cancelled request leaves it and its rows are freed.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from h2o_kv import policies
from h2o_kv.backends import native
from h2o_kv.cache.attention import enable
from h2o_kv.cache.formats import check_kv_dtype
from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import Policy
from h2o_kv.runtime.admission import SlotCount
from h2o_kv.runtime.generation import Sampling, decode_step, forward, sample
from h2o_kv.runtime.request import Completion, Event, Request

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
    ) -> None:
        # the defaults must make sense; a Full default keeps `budget` for requests naming a bounded policy
        policies.build(policy, None if str(policy).lower() == "full" else budget, sinks=sinks)
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if kv_memory is not None and (isinstance(kv_memory, bool) or not isinstance(kv_memory, int) or kv_memory < 1):
            raise ValueError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
        self.model, self.tokenizer = enable(model), tokenizer
        check_kv_dtype(kv_dtype)
        if model.device.type == "cpu" and native.resolve(None):  # what the engine's caches (compile_kernel=None) use
            native.load()  # the C++ kernels, built (once per machine) before the first request, not in its first step
        self.policy, self.budget, self.sinks, self.mode, self.kv_dtype = policy, budget, sinks, mode, kv_dtype
        self.kv_memory, self.max_batch, self.prefill_chunk = kv_memory, max_batch, prefill_chunk
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context_limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self._count = SlotCount(config, model.dtype, kv_dtype, mode, prefill_chunk)
        self.eos = eos_ids(model, tokenizer)
        self._lock = threading.Condition()  # guards the waiting queue (submit never waits for a step)
        self._state = threading.Lock()  # held by a step while it changes the batches; stats() reads under it
        self._waiting: deque[Request] = deque()  # submitted, not admitted
        self._prefill: deque[tuple[Request, KVCache]] = deque()  # admitted, prompt going in
        self._groups: dict[Policy, tuple[KVCache, list[Request]]] = {}  # decoding, by policy
        self._thread: threading.Thread | None = None
        self._closing = False
        self.generated_tokens = 0
        self.finished_requests = 0
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
    ) -> Request:
        """Queue a prompt (token ids); raises ValueError at once for anything that cannot be served."""
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("the prompt is empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be non-empty strings")
        built = self.resolve_policy(policy, budget)
        length = len(prompt_ids)
        if built.capacity(torch.tensor([length])) is None and length + max_tokens > self.context_limit:
            raise ValueError(
                f"prompt ({length} tokens) + max_tokens ({max_tokens}) exceed the model's context of "
                f"{self.context_limit} tokens with the unbounded {built.describe()} cache"
            )
        kv_bytes = self.kv_bytes_for(length, max_tokens, built)
        if self.kv_memory is not None and kv_bytes > self.kv_memory:
            raise ValueError(
                f"this request needs {kv_bytes} bytes of KV cache under {built.describe()}, more than the "
                f"{self.kv_memory} allowed: shorten the prompt or max_tokens, or lower the budget"
            )
        sampling = sampling or Sampling()
        request = Request(
            list(prompt_ids), built, max_tokens, sampling, stop, kv_bytes, self._detokenize, on_event=on_event
        )
        request.generator = sampling.generator(self.model.device)
        request.ignore_eos = bool(ignore_eos)
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self._waiting.append(request)
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
            return policy
        name = policy or self.policy
        if budget is None and str(name).lower() != "full":
            budget = self.budget  # None: a request naming a bounded policy must then give its own
        return policies.build(name, budget, sinks=self.sinks)

    def kv_bytes_for(self, prompt_len: int, max_tokens: int, policy: Policy | None = None) -> int:
        """Most KV bytes a request can hold while decoding (its admission size)."""
        return self._count.bytes(policy or self.resolve_policy(), prompt_len, max_tokens)

    def stats(self) -> dict:
        with self._state, self._lock:
            running = sum(len(rows) for _, rows in self._groups.values())
            return {
                "running": running + len(self._prefill),
                "waiting": self.waiting(),  # the queue's lock is reentrant (a Condition's RLock)
                "kv_bytes_in_use": self.kv_bytes_in_use(),
                "kv_bytes_reserved": self._reserved(),
                "kv_bytes_allowed": self.kv_memory,
                "running_peak": self.peaks["running"],
                "kv_bytes_peak": self.peaks["kv_bytes_in_use"],
                "generated_tokens": self.generated_tokens,
                "finished_requests": self.finished_requests,
            }

    def waiting(self) -> int:
        """Requests submitted and not admitted yet. Reads the queue alone, so it never waits for a step (the
        server's queue limit asks on its event loop)."""
        with self._lock:
            return len(self._waiting)

    def kv_bytes_in_use(self) -> int:
        caches = [cache for cache, _ in self._groups.values()] + [cache for _, cache in self._prefill]
        return sum(cache.nbytes() for cache in caches)

    def reset_peaks(self) -> None:
        """Start the high-water marks of `stats()` again from what is held now (a load test per config)."""
        with self._state, self._lock:
            self.peaks = {"running": 0, "kv_bytes_in_use": 0}
            self._note_peaks()

    def _note_peaks(self, kv_bytes: bool = True) -> None:
        """Called where a step holds most: after admission (requests; the new caches are still empty) and
        after each forward (requests and KV bytes), before anyone leaves."""
        self.peaks["running"] = max(self.peaks["running"], self._running())
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
                for request in self._all_requests():
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
        """Admit, one prefill chunk, one decode step. Returns False when there was nothing to do."""
        with self._state:
            return self._step()

    def _step(self) -> bool:
        with self._lock:
            self._drop_cancelled()
            self._admit()
            self._note_peaks(kv_bytes=False)
            work = bool(self._prefill or self._groups)
        if self._prefill:
            self._prefill_chunk()
        if self._groups:
            self._decode()
        return work or bool(self._waiting)

    def _loop(self) -> None:
        while True:
            with self._lock:
                idle = not (self._waiting or self._prefill or self._groups)
                if idle and self._closing:
                    return
                if idle:
                    self._lock.wait(timeout=0.5)
                    continue
            self.step()

    def _admit(self) -> None:
        while self._waiting and self._running() < self.max_batch:
            request = self._waiting[0]
            if self.kv_memory is not None and self._projected(request) > self.kv_memory:
                return  # FIFO: nothing overtakes the head of the queue
            self._waiting.popleft()
            cache = KVCache(request.policy, mode=self.mode, prompt_len=request.prompt_tokens, kv_dtype=self.kv_dtype)
            self._prefill.append((request, cache))

    def _prefill_chunk(self) -> None:
        request, cache = self._prefill[0]
        done = cache.seen_tokens
        ids = request.prompt_ids[done : done + (self.prefill_chunk or request.prompt_tokens)]
        device = self.model.device
        positions = torch.arange(done, done + len(ids), device=device).view(1, -1)
        try:
            logits = forward(self.model, cache, torch.tensor([ids], device=device), positions=positions)
        except Exception as err:  # the request fails, visibly; everyone else goes on
            self._prefill.popleft()
            self._finish(request, "error", f"{type(err).__name__}: {err}")
            return
        self._note_peaks()
        if done + len(ids) < request.prompt_tokens:
            return
        self._prefill.popleft()
        token = self._sample(request, logits[0])
        if token is None:
            return
        if self._push(request, token):
            _record(request, cache, 0)
            return
        group = self._groups.get(request.policy)
        if group is None:
            self._groups[request.policy] = (cache, [request])
        else:
            group[0].append_rows(cache)
            group[1].append(request)

    def _decode(self) -> None:
        device = self.model.device
        for policy, (cache, rows) in list(self._groups.items()):
            tokens = torch.tensor([r.token_ids[-1] for r in rows], device=device)
            positions = torch.tensor([r.position for r in rows], device=device)
            try:
                logits = decode_step(self.model, cache, tokens, positions)
            except Exception as err:
                del self._groups[policy]
                for request in rows:
                    self._finish(request, "error", f"{type(err).__name__}: {err}")
                continue
            self._note_peaks()
            greedy = logits.argmax(-1).tolist()
            tokens = [greedy[i] if r.sampling.greedy else self._sample(r, logits[i]) for i, r in enumerate(rows)]
            finished = [token is None or self._push(r, token) for r, token in zip(rows, tokens)]
            if any(finished):
                for i, gone in enumerate(finished):
                    if gone and tokens[i] is not None:
                        _record(rows[i], cache, i)
                self._leave(policy, [i for i, gone in enumerate(finished) if not gone])

    def _sample(self, request: Request, logits: torch.Tensor) -> int | None:
        """The request's next token from its logits [V]; None when sampling fails (the request ends with the error,
        everyone else goes on: one request's settings never stop the engine)."""
        try:
            return sample(logits, request.sampling, request.generator)
        except Exception as err:
            self._finish(request, "error", f"{type(err).__name__}: {err}")
            return None

    def _push(self, request: Request, token: int) -> bool:
        self.generated_tokens += 1
        if request.push(token, token in self.eos and not request.ignore_eos):
            self.finished_requests += 1
            return True
        return False

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        request.finish(reason, error)
        self.finished_requests += 1

    def _leave(self, policy: Policy, keep: list[int]) -> None:
        cache, rows = self._groups[policy]
        if not keep:
            del self._groups[policy]
            return
        cache.select_rows(keep)
        self._groups[policy] = (cache, [rows[i] for i in keep])

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish(request, "cancelled")
        for item in [item for item in self._prefill if item[0].cancelled]:
            self._prefill.remove(item)
            self._finish(item[0], "cancelled")
        for policy, (cache, rows) in list(self._groups.items()):
            if any(r.cancelled for r in rows):
                for i, request in enumerate(rows):
                    if request.cancelled:
                        _record(request, cache, i)  # what it held when it stopped
                        self._finish(request, "cancelled")
                self._leave(policy, [i for i, r in enumerate(rows) if not r.cancelled])

    # -- memory accounting ---------------------------------------------------------------------------------
    def _projected(self, extra: Request) -> int:
        """KV bytes if `extra` were admitted: every batch at its widest row (prompts still going in
        counted in their batch), plus the largest prompt in flight (one prompt is prefilled at a time)."""
        groups: dict[Policy, list[int]] = {}
        prefill = 0
        for request in [*self._all_running(), extra]:
            decode, prompt = self._count.slots(request.policy, request.prompt_tokens, request.max_tokens)
            groups.setdefault(request.policy, []).append(decode)
            if request is extra or any(request is r for r, _ in self._prefill):
                prefill = max(prefill, prompt)
        slots = sum(len(widths) * max(widths) for widths in groups.values()) + prefill
        return slots * self._count.layout

    def _reserved(self) -> int:
        return sum(r.kv_bytes for r in self._all_running())

    def _running(self) -> int:
        return len(self._prefill) + sum(len(rows) for _, rows in self._groups.values())

    def _all_running(self) -> list[Request]:
        return [r for r, _ in self._prefill] + [r for _, rows in self._groups.values() for r in rows]

    def _all_requests(self) -> list[Request]:
        return list(self._waiting) + self._all_running()

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _record(request: Request, cache: KVCache, row: int) -> None:
    """What a finished request's cache held at its end: kept and seen tokens, and its share of the bytes."""
    layer = cache.layers[0]
    request.cache_stats = {
        "kept_tokens": int(cache.kept_per_head()[:, row].max()),
        "seen_tokens": int(layer.next_pos[row].max()),
        "kv_bytes": cache.nbytes() // cache.batch_size,  # allocated, this row's share
        "kv_kept_bytes": sum(layer.kept_nbytes(row) for layer in cache.layers),  # held by this row's kept tokens
    }


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end a sequence: the model's generation config's and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids

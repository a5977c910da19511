"""The step runner: one engine iteration's model calls and what their logits become.

`prefill` feeds the next chunk of the prompts going in (the scheduler's `prefill_turn`: the oldest, and a prompt one
chunk finishes) and, once a prompt is all in, samples its first token and lets the request join its policy's batch;
`decode` steps one policy's batch and lets its finished rows go. A prompt continues where its cache has seen it to
(`seen_tokens`: a kept prefix's fork starts past it), and a request that ends with its answer leaves its cache to the
scheduler's prefix store (`Scheduler.keep`). A KVzip request with a new cache prefills in its reconstruction pass
(reconstructing.py): held chunks, the first token from the last one, then one reconstruction call per step
(`_score_call`), then it joins. The model calls are eager `forward`s here (`_prefill_call`, `_score_call`,
`_decode_call`); on a GPU, captured.py's `CapturedSteps` replays a batch's steady step recorded once per batch bucket
at `_decode_call`, and nothing else changes. A request whose call or sampling fails ends with the error; everyone else
goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import Policy
from h2o_kv.runtime.batch import record
from h2o_kv.runtime.generation import decode_step, forward, sample
from h2o_kv.runtime.reconstructing import Reconstructing
from h2o_kv.runtime.request import Request
from h2o_kv.runtime.scheduler import Scheduler


class EagerSteps:
    """Every model call an eager forward of `model`; counts the tokens generated and the requests finished.
    `held` is called after each forward, when a step holds most (the engine's high-water marks)."""

    def __init__(self, model: torch.nn.Module, *, eos: set[int], prefill_chunk: int | None,
                 held: Callable[[], None]) -> None:  # fmt: skip
        self.model, self.eos, self.prefill_chunk, self.held = model, eos, prefill_chunk, held
        self.generated_tokens = 0
        self.finished_requests = 0

    def prefill(self, runs: Scheduler) -> None:
        """This step's prompt chunks (`Scheduler.prefill_turn`)."""
        for item in runs.prefill_turn(self.prefill_chunk):
            self._prefill_chunk(runs, item)

    def _prefill_chunk(self, runs: Scheduler, item: tuple[Request, KVCache]) -> None:
        """The next call of one prompt going in (a chunk, or in a reconstruction pass a held chunk or a reconstruction
        call); the first token once the prompt is all in; once it is through (its pass left), the request joins its
        policy's batch, or ends there if its first token ended it. A failed call ends the request with the error."""
        request, cache = item
        done, logits = cache.seen_tokens, None
        ids = request.prompt_ids[done : done + (self.prefill_chunk or request.prompt_tokens)]  # none once held
        try:
            if ids:
                logits = self._prefill_call(cache, ids, done)
            else:
                self._score_call(runs.passes[request])
        except Exception as err:
            runs.end_prefill(item, err)
            self.finish(request, "error", f"{type(err).__name__}: {err}")
            return
        self.held()
        if ids and done + len(ids) == request.prompt_tokens:  # the prompt is in: its first token
            token = self._sample(request, logits[0])
            if token is None:
                runs.end_prefill(item, RuntimeError(request.error))
                return
            self._push(request, token)
        if runs.calls_left(item, self.prefill_chunk) > 0:
            return
        try:
            runs.end_prefill(item)  # and its pass, if any, is left: ranked to the capacity
            cache.end_prompt()  # the prompt is through: the engine's headroom joins the row's capacity
        except Exception as err:
            self.finish(request, "error", f"{type(err).__name__}: {err}")
            return
        if request.done:
            record(request, cache, 0)
            runs.keep(request, cache)
            runs.trim()
            return
        runs.keep_prompt(request, cache)  # before its first step: what it has seen is the prompt
        runs.join(request, cache, self.model.device)

    def decode(self, runs: Scheduler, policy: Policy) -> None:
        """One decode step of a policy's batch: each row's next token, and the finished rows leave."""
        batch = runs.batches[policy]
        rows = batch.requests
        try:
            logits = self._decode_call(batch.cache, batch.tokens, batch.positions)
        except Exception as err:
            del runs.batches[policy]
            for request in rows:
                self.finish(request, "error", f"{type(err).__name__}: {err}")
            return
        self.held()
        argmax = logits.argmax(-1)  # every cache row's, free ones' too (`Batch.in_place`): the next step's input
        greedy = argmax.tolist()
        tokens = [greedy[k] if r.sampling.greedy else self._sample(r, logits[k]) for r, k in zip(rows, batch.rows)]
        finished = [i for i, (r, token) in enumerate(zip(rows, tokens)) if token is None or self._push(r, token)]
        for i in finished:
            if tokens[i] is not None:
                batch.record(i)
                runs.keep(rows[i], batch.cache, batch.rows[i])  # before its row is freed
        batch.advance(tokens, argmax if all(r.sampling.greedy for r in rows) else None)
        if finished:
            runs.leave(policy, finished)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request without a new token (cancelled, or an error); one that has ended stays as it ended."""
        if request.done:
            return
        request.finish(reason, error)
        self.finished_requests += 1

    def _prefill_call(self, cache: KVCache, ids: list[int], start: int) -> torch.Tensor:
        """Prompt tokens `ids` of one sequence at absolute positions from `start`: the last one's logits [1, V]."""
        device = self.model.device
        positions = torch.arange(start, start + len(ids), device=device).view(1, -1)
        return forward(self.model, cache, torch.tensor([ids], device=device), positions=positions)

    def _score_call(self, job: Reconstructing) -> None:
        """The next reconstruction call of a pass (`Reconstructing.score_next`)."""
        job.score_next(self.model)

    def _decode_call(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row (tokens, positions [B] on the model's device): the next logits [B, V]."""
        return decode_step(self.model, cache, tokens, positions)

    def _sample(self, request: Request, logits: torch.Tensor) -> int | None:
        """The request's next token from its logits [V]; None when sampling fails (the request ends with the error,
        everyone else goes on: one request's settings never stop the engine)."""
        try:
            return sample(logits, request.sampling, request.generator)
        except Exception as err:
            self.finish(request, "error", f"{type(err).__name__}: {err}")
            return None

    def _push(self, request: Request, token: int) -> bool:
        self.generated_tokens += 1
        if request.push(token, token in self.eos and not request.ignore_eos):
            self.finished_requests += 1
            return True
        return False

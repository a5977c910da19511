"""One full prefill for every policy of a "oneshot" study: record the attention calls once, replay them per policy.

In the oneshot setting each layer attends over the whole prompt and evicts only after that attention,
so the prefill's hidden states and its last logits do not depend on the policy. Running the model over
a long prompt once per (policy, budget) repeats the same work: on a 2-core CPU a 4k-token prompt takes
30 s on Qwen2.5-0.5B, and a study has a dozen policies x budgets. Here the model reads a prompt once
with a Full `KVCache` whose layers keep each attention call's inputs (queries, keys, values, mask);
each policy's fresh cache then receives those calls layer by layer (its insert, scoring and eviction,
exactly what the layer would do inside the model), and decodes its answer greedily on its own cache.

Query-agnostic (`question_ids`): the recorded prompt is the context alone, so each cache compresses the context
without the question; the question then goes into each cache as a second model call (positions after the context),
and the answer is decoded from that call's logits. Several questions (`shared_answers`): each cache compresses the
context once, and each question is answered from its own `KVCache.fork` of it ("compress once, ask many"). Every
answer of a prompt is decoded together (`greedy_together`): one model call a step over all the (cache, question)
rows still going, each row attending with its own cache, so a step reads the weights once, not once per row.

The caches of one prompt share the replay's attention (`SharedAttention`): a recorded call's scores depend on the
policy only through what it asks (every query's attention, an observation window's, the last query's), not on its
budget, so each distinct request is computed once per prompt and the other (policy, fraction) pairs reuse it; a
replay that asks for no scores (StreamingLLM, KeyDiff, Full) attends not at all, since its output is dropped.

KVzip's pass (``policy.reconstructs``, `h2o_kv.compress`) is recorded once per prompt too: during the pass nothing is
evicted, so its held call and its reconstruction calls see the same context whatever the budget or the allocation
(per head, or `whole_cache`); `record_pass` runs it once on a cache that keeps every token, and `replay_pass` feeds
those calls into each KVzip cache inside its own pass, which scores and ranks as `compress` would; query-aware, its
first token comes from the pass's held call (every prompt token in the cache), as a served request's and kvpress's
do (`compress_with_logits`). A cache that cannot take recorded calls reads the prompt itself (`_own_prefill`): int8
storage (its attention runs on rounded keys), so any policy `policies.build` knows is one more entry of a study.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from h2o_kv.cache.attention import hand_off, mark_forward
from h2o_kv.cache.kvcache import KVCache
from h2o_kv.cache.layer import KVLayer
from h2o_kv.cache.reconstruct import PassPeaks
from h2o_kv.cache.routes import Call, Slots, attend
from h2o_kv.policies import Full, KVzip, Policy
from h2o_kv.runtime.generation import forward, greedy_together

ROWS = 32  # (cache, question) rows decoded together at most: a step of 32 rows costs a row a sixth of its own step


class _RecordingLayer(KVLayer):
    """A Full layer that keeps the inputs of each attention call (keys, values, queries, mask, options)."""

    calls: list

    def forward_attention(self, query, attention_mask, **options):
        keys, values = self.pending
        self.calls.append((keys, values, query, attention_mask, options))
        return super().forward_attention(query, attention_mask, **options)


class _Recording(KVCache):
    def __init__(self, policy: Policy | None = None) -> None:
        super().__init__(policy or Full())
        self.calls: list[list] = []

    def _new_layer(self) -> KVLayer:
        layer = _RecordingLayer(self.settings, len(self.layers))
        layer.calls = []
        self.calls.append(layer.calls)
        return layer


def record_prefill(model: Any, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, list[list]]:
    """Read one prompt (batch 1) in one call: its last logits [1, V] and each layer's attention calls."""
    recording = _Recording()
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    with torch.no_grad():
        logits = forward(model, recording, ids)
    return logits, recording.calls


def record_pass(
    model: Any, prompt_ids: Sequence[int], tokenizer: Any, *, chunk: int | None = None, peaks: PassPeaks | None = None
) -> tuple[torch.Tensor, list[list]]:
    """KVzip's pass over one prompt (batch 1), run once by `h2o_kv.compress` on a cache that keeps every token: the
    held call's last logits [1, V] (the next token's, every prompt token in the cache: as a served request and
    kvpress take the first token) and each layer's attention calls, the held context's first, then one per
    reconstruction call (`replay_pass` feeds them). `chunk`: context tokens per reconstruction call (`compress`'s
    default without one). `peaks`: filled with each scoring call's peak attention, which the replays given it reuse
    (the recording's layers compute them anyway)."""
    from h2o_kv.runtime.compress import CHUNK, compress_with_logits

    recording = _Recording(KVzip(budget=max(2, len(prompt_ids))))
    if peaks is not None:
        recording.settings.peaks, peaks.outputs = peaks, True
    try:
        with torch.no_grad():
            ids = torch.tensor([list(prompt_ids)], device=model.device)
            _, logits = compress_with_logits(model, ids, cache=recording, tokenizer=tokenizer, chunk=chunk or CHUNK)
    finally:
        recording.settings.peaks = None
        if peaks is not None:
            peaks.outputs = False
    return logits, recording.calls


def held_call(passed: tuple[torch.Tensor, list[list]]) -> tuple[torch.Tensor, list[list]]:
    """`record_prefill`'s recording from `record_pass`'s: the pass's held call is the prompt in one call, every token
    kept and nothing scored, the model's own call on the prompt (tested equal, call for call), so its logits and
    each layer's first call serve the caches that replay a prefill."""
    logits, calls = passed
    return logits, [layer_calls[:1] for layer_calls in calls]


def replay_pass(cache: KVCache, calls: list[list], peaks: PassPeaks | None = None) -> KVCache:
    """KVzip's pass in `cache` (an empty cache of a policy that `reconstructs`) from `record_pass`'s calls: the held
    call, then each reconstruction call as a scoring call; leaving the pass ranks, then the prompt ends, as
    `h2o_kv.compress` leaves it. The outputs are dropped (a scoring call computes none); returns `cache`. `peaks`:
    kept across the replays of these calls (and filled by `record_pass`), so that each scoring call's peak attention
    is computed once whatever each cache's budget and layout."""
    cache.settings.peaks = PassPeaks() if peaks is None else peaks
    try:
        with cache.reconstruction() as rec:
            replay(cache, calls, only=range(1))
            for call in range(1, len(calls[0])):
                with rec.scoring():
                    replay(cache, calls, only=range(call, call + 1))
    finally:
        cache.settings.peaks = None
    cache.end_prompt()
    return cache


class SharedAttention:
    """`routes.attend` for the calls of replays of one recording (`Settings.attention` while `replay` runs): the
    outputs are dropped (None: asked off, `Call.want_out`, so a route computes them only where they come with the
    scores), a call that asks for neither scores nor the last query's attention computes nothing,
    and a layer's first call (the storage holding just the recorded keys, in order: `new_from` 0) is computed once per
    distinct request (the recorded query, the storage's layout, the call's options), later replays getting copies
    of its scores. Keep one per recording: the key holds the recorded query's address."""

    def __init__(self) -> None:
        self.done: dict[tuple, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.computed = 0  # attention calls actually run

    def __call__(self, q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call, *, native_kernels: bool = False):
        if not (call.want_scores or call.want_last):
            return None, None, None
        call = replace(call, want_out=False)  # the outputs are the recording's: a route need not compute them
        if call.new_from != 0:  # a later call: the storage holds more than this recording's keys
            self.computed += 1
            return None, *attend(q, kv, qpos, call, native_kernels=native_kernels)[1:]
        layout = [(t.dtype, tuple(t.shape), t.stride()) for t in kv if isinstance(t, torch.Tensor)]
        key = (q.data_ptr(), tuple(q.shape), q.stride(), q.dtype, tuple(layout), call, native_kernels)
        if key not in self.done:
            self.computed += 1
            _, scores, last = attend(q, kv, qpos, call, native_kernels=native_kernels)
            self.done[key] = (scores, last)
        return None, *(None if t is None else t.clone() for t in self.done[key])  # a layer may add to them in place


def replay(
    cache: KVCache, calls: list[list], shared: SharedAttention | None = None, *, only: range | None = None
) -> KVCache:
    """Feed the recorded attention calls of every layer into `cache`, as the model would have; returns it.

    The attention outputs are dropped (they equal the recorded run's); what remains is the cache's state. Each call's
    options are the ones the model passed (its config among them, for a per-layer policy's budget). `shared`: the
    replays of this recording so far, whose scores this one reuses (a fresh one by default). `only`: the calls fed
    (all by default).
    An int8 cache is refused: its prefill attends over its rounded keys, so later layers see other inputs.
    """
    if cache.settings.kv_dtype is not None:
        raise ValueError(f"a {cache.settings.kv_dtype} cache cannot replay a shared prefill (its attention differs)")
    cache.settings.attention = SharedAttention() if shared is None else shared
    try:
        with torch.no_grad():
            for call in range(len(calls[0])) if only is None else only:
                for layer_idx, layer_calls in enumerate(calls):
                    keys, values, query, mask, options = layer_calls[call]
                    if layer_idx == 0:
                        mark_forward(keys.shape[0], keys.shape[2])
                    cache.update(keys, values, layer_idx)
                    hand_off(None, keys)  # the layer is called here, not through the attention function
                    cache.layers[layer_idx].forward_attention(query, mask, **options)
    finally:
        cache.settings.attention = None
    return cache


def shared_greedy(
    model: Any,
    prompt_ids: Sequence[int],
    caches: dict[Any, Callable[[], KVCache]],
    *,
    max_new_tokens: int,
    eos: set[int] = frozenset(),
    done: Callable[[list[int]], bool] | None = None,
    question_ids: Sequence[int] = (),
    tokenizer: Any = None,
) -> dict[Any, tuple[list[int], int]]:
    """Greedy answers of one prompt under each cache of `caches` ({key: a function making a fresh cache}), from
    one recorded prefill, with the bytes each cache's kept tokens hold after the prompt (`kept_nbytes`). Each
    answer stops at EOS (kept), `max_new_tokens` or `done(tokens)`. A cache that cannot replay (int8) reads the
    prompt itself (KVzip's pass needs `tokenizer`). With `question_ids` the prompt is compressed alone and the question
    is each cache's next call (the bytes are still those after the prompt, before the question). `shared_answers`
    with one question."""
    answers = shared_answers(model, prompt_ids, caches, [question_ids], max_new_tokens=max_new_tokens, eos=eos,
                             done=[done], tokenizer=tokenizer)  # fmt: skip
    return {key: (outs[0], kv_bytes) for key, (outs, kv_bytes) in answers.items()}


def shared_answers(
    model: Any,
    prompt_ids: Sequence[int],
    caches: dict[Any, Callable[[], KVCache]],
    questions: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos: set[int] = frozenset(),
    done: Sequence[Callable[[list[int]], bool] | None] | None = None,
    tokenizer: Any = None,
    max_rows: int = ROWS,
) -> dict[Any, tuple[list[list[int]], int]]:
    """{key: (the greedy answer to each of `questions`, the cache's kept bytes after the prompt)}: each cache of
    `caches` compresses the prompt once (replaying the one recorded prefill, or reading it itself), then each question
    (token ids) is that cache's next call, at the positions after the prompt, from its own `KVCache.fork` (the last
    from the cache itself). An empty question answers from the prompt's own last logits (query-aware). `done`: one
    stopping test per question (or None). The answers are decoded together, one model call a step (`greedy_together`)
    over the (cache, question) rows of as many caches as fill `max_rows` (at least one cache), which are then let
    go: the memory held is that many caches', whatever the number of configurations. The prefill is recorded at the
    first cache that replays it (or is KVzip's pass's held call, when a KVzip cache is among them), so caches that all
    read the prompt themselves cost no recording."""
    recorded, passed, shared, peaks = None, None, SharedAttention(), PassPeaks()
    logits_needed = not all(questions)  # query-aware: the first token from the prompt's own (held) call
    n, last = len(prompt_ids), len(questions) - 1
    stops = [None] * len(questions) if done is None else list(done)
    if len(stops) != len(questions):
        raise ValueError(f"done: one stopping test per question ({len(questions)}), got {len(stops)}")
    rows, kv_bytes = [], {}  # one row per (cache, question): its cache, its next-token logits, its next position
    answers: dict[Any, tuple[list[list[int]], int]] = {}
    pending = {key: make() for key, make in caches.items()}  # empty until their calls: each let go after its rows
    kvzip = [cache for cache in pending.values() if cache.settings.kv_dtype is None and _reconstructs(cache)]
    if kvzip:  # KVzip's pass recorded once; its held call is the prompt's own, which the other caches replay
        passed = record_pass(model, prompt_ids, _tokenizer_for(kvzip[0], tokenizer), peaks=peaks)
        recorded = held_call(passed)
    for key in caches:
        if rows and len(rows) + len(questions) > max_rows:
            _decode_rows(model, rows, max_new_tokens, eos, kv_bytes, answers)
        cache = pending.pop(key)
        with torch.no_grad():
            if cache.settings.kv_dtype is None and not _reconstructs(cache):
                recorded = recorded or record_prefill(model, prompt_ids)
                first = recorded[0]
                replay(cache, recorded[1], shared)
                cache.end_prompt()  # the prompt is complete: a question is its next call, the headroom counts
            elif cache.settings.kv_dtype is None:  # KVzip: its recorded pass, the first token from its held call
                replay_pass(cache, passed[1], peaks)
                first = passed[0] if logits_needed else None
            else:
                first = _own_prefill(model, cache, prompt_ids, tokenizer, logits_needed=logits_needed)
            kv_bytes[key] = cache.kept_nbytes()
            for i, question in enumerate(questions):
                mine = cache if i == last else cache.fork()
                logits = first
                if question:
                    ids = torch.tensor([list(question)], device=model.device)
                    positions = torch.arange(n, n + len(question), device=model.device).unsqueeze(0)
                    logits = forward(model, mine, ids, positions=positions)
                rows.append((key, mine, logits, n + len(question), stops[i]))
    _decode_rows(model, rows, max_new_tokens, eos, kv_bytes, answers)
    return {key: answers[key] for key in caches}


def _decode_rows(model: Any, rows: list, max_new_tokens: int, eos: set[int], kv_bytes: dict, answers: dict) -> None:
    """The pending rows' answers, decoded together, into `answers` ({key: (answers in question order, bytes)});
    `rows` is emptied, its caches let go."""
    with torch.no_grad():
        outs = greedy_together(model, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                               max_new_tokens, eos, [r[4] for r in rows])  # fmt: skip
    for (key, *_), out in zip(rows, outs, strict=True):
        answers.setdefault(key, ([], kv_bytes[key]))[0].append(out)
    rows.clear()


def _tokenizer_for(cache: KVCache, tokenizer: Any) -> Any:
    if tokenizer is None:
        raise ValueError(f"{cache.settings.policy.describe()} repeats the context: the shared prefill needs tokenizer=")
    return tokenizer


def _reconstructs(cache: KVCache) -> bool:
    return bool(getattr(cache.settings.policy, "reconstructs", False))


def _own_prefill(model: Any, cache: KVCache, ids: Sequence[int], tokenizer: Any, *, logits_needed: bool):
    """The prompt read into `cache` by itself: in one call, or by `h2o_kv.compress` for a policy with a pass of its
    own (the first token then from its held call's logits when they are needed: query-aware)."""
    tensor = torch.tensor([list(ids)], device=model.device)
    if not _reconstructs(cache):
        logits = forward(model, cache, tensor)
        cache.end_prompt()  # as a replayed cache: a question is the next call, the headroom counts
        return logits
    from h2o_kv.runtime.compress import compress_with_logits

    _, logits = compress_with_logits(model, tensor, cache=cache, tokenizer=_tokenizer_for(cache, tokenizer))
    return logits if logits_needed else None

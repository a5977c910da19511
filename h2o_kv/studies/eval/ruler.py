"""Seeded, offline long-context retrieval tasks (RULER-style) and RULER's string-match scoring.

Why synthetic tasks: they probe exactly what KV eviction can break, i.e. whether a few tokens deep in a
long context (a needle, a variable chain, word frequencies) survive in the cache until the question
is asked, and their answers are known by construction so scoring needs no judge model.

Task definitions, templates and metrics follow RULER (Hsieh et al. 2024, arXiv 2404.06654):

* ``passkey``: the classic pass-key retrieval (Mohtashami & Jaggi 2023) hidden in filler text.
* ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." at a depth.
* ``niah_multikey``: the same plus distractor needles with other keys (and other values).
* ``variable_tracking``: chains "VAR A = 12345", "VAR B = VAR A", ...; answer: every variable in the
  chain that holds the queried value (other chains, if requested, use other values).
* ``common_words``: a numbered word list where a few words repeat many times; answer: the top-k.

RULER's own thirteen tasks, with its names (``niah_single_1`` ... ``qa_2``, `RULER_TASKS`), come from
``ruler_tasks.make_ruler_sample`` (generators in ``ruler_niah``, ``ruler_words``, ``ruler_qa``; settings in
``ruler_spec``); their samples also split the prompt into ``context`` and ``question`` for query-agnostic runs,
and :func:`score` applies each one's RULER metric (``string_match_part`` for the QA pair).

The filler is real text passed in by the caller (``haystack``); nothing is downloaded. Prompts are
sized with the caller's ``tokenizer_len`` so they end just below ``context_tokens``, and every prompt
ends with an answer prefix (stored in ``sample.metadata["answer_prefix"]``) so a greedy continuation
can be scored directly with :func:`score`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from h2o_kv.studies.eval.ruler_build import Filler, check_depth, common_words, niah, passkey, variable_tracking
from h2o_kv.studies.eval.ruler_spec import ALL, METRICS, PART, RULER_TASKS, SPECS

__all__ = [
    "RULER_TASKS",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "Sample",
    "asked",
    "hf_tokenizer_len",
    "make_dataset",
    "make_sample",
    "max_new_tokens",
    "score",
    "string_match_all",
    "string_match_part",
]

TASKS: tuple[str, ...] = ("passkey", "niah_single", "niah_multikey", "variable_tracking", "common_words")
# RULER's thirteen tasks with its own names (ruler_spec.py; built by ruler_tasks.make_ruler_sample) come after these
# five, h2o-kv's first RULER-style set, which keep their prompts and seeds so earlier results stay reproducible.

#: Generation budget per task. niah / vt / cwe are RULER's ``tokens_to_generate``; passkey is not a
#: RULER task: its 5-digit answer needs ~6 tokens, 16 leaves room (use ~48 with ``value_kind="uuid"``).
TOKENS_TO_GENERATE: dict[str, int] = {
    "passkey": 16,
    "niah_single": 128,
    "niah_multikey": 128,
    "variable_tracking": 30,
    "common_words": 120,
}


@dataclass
class Sample:
    """One evaluation prompt with its gold answers.

    ``prompt`` is context + question + answer prefix; ``context_tokens`` is the requested length bucket
    (the measured prompt length is ``metadata["prompt_tokens"]``, never above it); ``depth`` is the
    query needle's requested depth in [0, 1] (``None`` for tasks without a single needle). RULER's thirteen
    tasks also split the prompt: ``context`` (compressed alone when query-agnostic) + ``question`` (RULER's
    question and answer prefix, fed after it); older tasks leave both empty. ``metric`` is RULER's for the task.
    ``questions``: (question, golds) of each question over the one context when a sample has several
    (`ruler_tasks`' ``questions=``), the first being ``question`` / ``answers``; empty for one question.
    """

    prompt: str
    answers: list[str]
    task: str
    context_tokens: int
    depth: float | None
    metadata: dict[str, Any] = field(default_factory=dict)
    context: str = ""
    question: str = ""
    metric: str = ALL
    questions: list[tuple[str, list[str]]] = field(default_factory=list)


def asked(sample: Sample) -> list[Sample]:
    """One sample per question of `sample` (its context, that question and its golds; scored by `score`); a
    one-question sample is itself."""
    if not sample.questions:
        return [sample]
    n = len(sample.questions)
    return [
        replace(sample, prompt=sample.context + q, question=q, answers=list(golds), questions=[],
                metadata={**sample.metadata, "question": i, "questions": n})
        for i, (q, golds) in enumerate(sample.questions)
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------- scoring


def string_match_all(pred: str, answers: Sequence[str]) -> float:
    """RULER ``string_match_all``: fraction of answers found (case-insensitive substring) in ``pred``."""
    if not answers:
        raise ValueError("string_match_all needs at least one answer")
    p = pred.lower()
    return sum(1.0 for a in answers if a.lower() in p) / len(answers)


def string_match_part(pred: str, answers: Sequence[str]) -> float:
    """RULER ``string_match_part``: 1.0 if any answer is found (case-insensitive substring) in ``pred``, else 0.0."""
    if not answers:
        raise ValueError("string_match_part needs at least one answer")
    p = pred.lower()
    return max(1.0 if a.lower() in p else 0.0 for a in answers)


def score(sample: Sample, prediction: str) -> float:
    """Score a generated continuation (the text after the prompt) with the sample's RULER metric:
    ``string_match_all`` for every task but RULER's qa_1 / qa_2 (``string_match_part``).

    Control characters are turned into newlines first, as RULER's ``postprocess_pred`` does. Any text
    works, but score only the generated continuation: the prompt itself contains the answers.
    """
    if sample.task not in TASKS and sample.task not in SPECS:
        raise ValueError(f"no metric for task {sample.task!r}; known: {TASKS + RULER_TASKS}")
    if sample.metric not in METRICS:
        raise ValueError(f"unknown metric {sample.metric!r}; known: {METRICS}")
    prediction = re.sub(r"[\x00-\x08\x0b-\x1f]", "\n", prediction).strip()
    return (string_match_part if sample.metric == PART else string_match_all)(prediction, sample.answers)


def max_new_tokens(task: str) -> int:
    """How many tokens to generate for ``task`` before scoring (see :data:`TOKENS_TO_GENERATE`)."""
    if task in SPECS:
        return SPECS[task].tokens
    try:
        return TOKENS_TO_GENERATE[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TOKENS_TO_GENERATE) + list(RULER_TASKS)}") from None


def hf_tokenizer_len(tokenizer: Any, *, add_special_tokens: bool = True) -> Callable[[str], int]:
    """Wrap a Hugging Face tokenizer as a ``tokenizer_len`` callable.

    ``add_special_tokens=True`` counts BOS etc., matching what the model sees when the runner encodes
    the prompt the same way, so the prompt never exceeds ``context_tokens``.
    """

    def _len(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    return _len


def make_sample(
    task: str,
    *,
    context_tokens: int,
    tokenizer_len: Callable[[str], int],
    haystack: str,
    seed: int,
    depth: float | None = None,
    value_kind: str = "number",
    num_keys: int = 4,
    num_chains: int = 1,
    num_hops: int = 4,
    num_common: int = 10,
    common_freq: int | None = None,
    uncommon_freq: int = 3,
) -> Sample:
    """Generate one sample of ``task`` whose prompt is just under ``context_tokens`` tokens.

    Deterministic in ``seed`` (all randomness comes from ``random.Random(seed)``). ``depth`` in [0, 1]
    places the (query) needle of passkey / niah tasks; ``None`` draws it from the seed. ``value_kind``
    ("number" or "uuid") picks needle values for passkey / niah. ``num_keys`` is the number of needles
    of ``niah_multikey`` (the queried one + distractors); ``num_chains``/``num_hops`` shape
    ``variable_tracking`` (extra chains are distractors); ``num_common``/``common_freq``/
    ``uncommon_freq`` shape ``common_words`` (``common_freq=None`` scales RULER's 30 down for short
    contexts). The defaults are RULER's.
    """
    if task in SPECS:
        raise ValueError(f"{task!r} is one of RULER's thirteen: build it with ruler_tasks.make_ruler_sample")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    if value_kind not in ("number", "uuid"):
        raise ValueError(f"value_kind must be 'number' or 'uuid', got {value_kind!r}")
    rng = random.Random(seed)
    if task in ("passkey", "niah_single", "niah_multikey"):
        depth = check_depth(depth, rng)
    else:
        depth = None
    if task == "common_words":
        if num_common < 1 or uncommon_freq < 1:
            raise ValueError("num_common and uncommon_freq must be >= 1")
        built = common_words(rng, haystack, tokenizer_len, context_tokens, num_common, common_freq, uncommon_freq)
    else:
        filler = Filler(haystack, rng)
        tpw = filler.tokens_per_word(tokenizer_len)
        if task == "passkey":
            built = passkey(rng, filler, tpw, tokenizer_len, context_tokens, depth, value_kind)
        elif task == "variable_tracking":
            if num_chains < 1 or num_hops < 0:
                raise ValueError("variable_tracking needs num_chains >= 1 and num_hops >= 0")
            built = variable_tracking(rng, filler, tpw, tokenizer_len, context_tokens, num_chains, num_hops)
        else:
            k = 1 if task == "niah_single" else num_keys
            if k < 1 or (task == "niah_multikey" and k < 2):
                raise ValueError(f"niah_multikey needs num_keys >= 2, got {num_keys}")
            built = niah(rng, filler, tpw, tokenizer_len, context_tokens, depth, value_kind, k)
    prompt, answers, t, meta = built
    meta = {"seed": seed, "prompt_tokens": t, "max_new_tokens": TOKENS_TO_GENERATE[task], **meta}
    return Sample(prompt=prompt, answers=answers, task=task, context_tokens=context_tokens, depth=depth, metadata=meta)


def make_dataset(
    task: str,
    n: int,
    context_tokens: int,
    *,
    tokenizer_len: Callable[[str], int],
    haystack: str,
    seed: int,
    depth: float | Sequence[float] | None = None,
    value_kind: str = "number",
    **options: Any,
) -> list[Sample]:
    """``n`` samples with per-sample seeds drawn from ``random.Random(seed)``.

    Seeds are drawn sequentially, so a smaller dataset is a prefix of a larger one with the same
    ``seed`` (handy for quick runs). ``depth`` may be a sequence to sweep needle depths (sample ``i``
    uses ``depth[i % len(depth)]``). Extra ``options`` go to :func:`make_sample`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seeds = [rng.getrandbits(32) for _ in range(n)]
    if depth is None or isinstance(depth, (int, float)):
        depths: list[float | None] = [None if depth is None else float(depth)] * n
    else:
        if len(depth) == 0:
            raise ValueError("depth sequence is empty")
        depths = [float(depth[i % len(depth)]) for i in range(n)]
    return [
        make_sample(
            task,
            context_tokens=context_tokens,
            tokenizer_len=tokenizer_len,
            haystack=haystack,
            seed=s,
            depth=d,
            value_kind=value_kind,
            **options,
        )
        for s, d in zip(seeds, depths, strict=True)
    ]

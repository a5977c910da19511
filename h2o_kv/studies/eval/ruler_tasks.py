"""RULER's thirteen tasks (`ruler_spec.RULER_TASKS`) as `ruler.Sample`s with a context / question split.

A sample's ``context`` is what a query-agnostic run compresses alone; its ``question`` is RULER's question followed by
the answer prefix, what comes after (in the same prompt when query-aware). ``prompt`` is the two joined, and the ids
are the context's followed by the question's (`ruler_fit.split_ids`), so both settings, and kvpress, read the same
tokens. Deterministic in the seed; ``metric`` is RULER's for the task.

``questions=k`` (k > 1) asks k independent questions over one context for the tasks of `SEVERAL_QUESTIONS` (the
multikey needles: one key each; QA: one gold document, or pair, each), the context fitted beside the longest of them;
``Sample.questions`` holds them, ``question`` / ``answers`` the first. Other tasks, and ``questions=1``, give today's
one-question sample exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from h2o_kv.studies.eval.ruler import Sample
from h2o_kv.studies.eval.ruler_fit import Built, Fitter
from h2o_kv.studies.eval.ruler_niah import niah
from h2o_kv.studies.eval.ruler_qa import qa
from h2o_kv.studies.eval.ruler_spec import RULER_TASKS, SEVERAL_QUESTIONS, SPECS, SUBSTITUTES
from h2o_kv.studies.eval.ruler_vocab import Words, load_words
from h2o_kv.studies.eval.ruler_words import cwe, fwe, vt

_BUILDERS: dict[str, Callable[..., Built]] = {"vt": vt, "cwe": cwe, "fwe": fwe, "qa": qa}


def make_ruler_sample(
    task: str,
    *,
    tokenizer: Any,
    context_tokens: int,
    haystack: str,
    seed: int,
    words: Words | None = None,
    questions: int = 1,
) -> Sample:
    """One sample of `task` whose context + question + RULER's answer length is just under `context_tokens` tokens.

    `haystack` is the running text (the essay haystack and the QA passages); `words` the word lists (default:
    wonderwords' from PyPI, `ruler_vocab.load_words`). `questions`: how many questions a task of `SEVERAL_QUESTIONS`
    asks over the context (others ask one).
    """
    if task not in SPECS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TASKS)}")
    if questions < 1:
        raise ValueError(f"questions must be at least 1, got {questions}")
    spec = SPECS[task]
    several = {"questions": questions} if questions > 1 and task in SEVERAL_QUESTIONS else {}
    rng = random.Random(seed)
    fitter = Fitter(tokenizer, context_tokens, spec.tokens)
    words = load_words() if words is None else words
    if spec.family == "niah":
        o = spec.options
        built = niah(rng, fitter, haystack, words, haystack_kind=o["haystack"], key=o["key"], value=o["value"],
                     keys=o["keys"], values=o["values"], queries=o["queries"], **several)  # fmt: skip
    else:
        built = _BUILDERS[spec.family](rng, fitter, haystack, words, **spec.options, **several)
    context, question, answers, meta = built
    asks = meta.pop("questions", [])
    meta = {"seed": seed, "prompt_tokens": fitter.context_tokens + fitter.question_tokens,
            "context_part_tokens": fitter.context_tokens, "question_tokens": fitter.question_tokens,
            "max_new_tokens": spec.tokens, "metric": spec.metric, **meta}  # fmt: skip
    if task in SUBSTITUTES:
        meta["substitute"] = SUBSTITUTES[task]
    return Sample(prompt=context + question, answers=answers, task=task, context_tokens=context_tokens, depth=None,
                  metadata=meta, context=context, question=question, metric=spec.metric, questions=asks)  # fmt: skip


def make_ruler_dataset(
    task: str,
    n: int,
    context_tokens: int,
    *,
    tokenizer: Any,
    haystack: str,
    seed: int,
    words: Words | None = None,
    questions: int = 1,
) -> list[Sample]:
    """`n` samples with per-sample seeds drawn in turn from `random.Random(seed)`: a smaller set is a prefix of a
    larger one with the same seed (more samples later reuse the cells of the first ones); the same seeds whatever
    `questions` is."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seeds = [rng.getrandbits(32) for _ in range(n)]
    return [make_ruler_sample(task, tokenizer=tokenizer, context_tokens=context_tokens, haystack=haystack, seed=s,
                              words=words, questions=questions) for s in seeds]  # fmt: skip

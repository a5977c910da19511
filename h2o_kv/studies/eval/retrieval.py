"""Long-context retrieval with a model: RULER-style samples (built by `ruler.py`), greedy answers, RULER scores.

The budget is resolved against the context length (prompts end just below it). Two prefill settings:
"oneshot" reads the prompt in one call and then evicts (the paper's generation setting: the question's
attention counts when choosing what to keep); "stream" feeds the prompt through the bounded cache in
chunks, so a needle must earn attention before the question arrives to survive. Oneshot runs sample by
sample with one shared prefill for every policy (`run_shared`, shared.py), each (sample, policy, budget)
stored as its own cell; stream runs all samples of a context as one left-padded batch per policy.

A sample with several questions (`make_samples(questions=k)`, RULER's multikey and QA tasks): query-agnostic
compresses its context once per policy and answers each question from a fork of that cache; query-aware and stream
read each question with the context as its own prompt. Rows average over every question of every sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import Any

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.runtime.generation import eos_ids
from h2o_kv.studies.eval.cells import Cells
from h2o_kv.studies.eval.decoding import greedy_generate, new_cache
from h2o_kv.studies.eval.ruler import TASKS, Sample, asked, hf_tokenizer_len, make_dataset, max_new_tokens, score
from h2o_kv.studies.eval.ruler_fit import split_ids
from h2o_kv.studies.eval.ruler_spec import RULER_TASKS
from h2o_kv.studies.eval.shared import shared_answers

SHARED_PREFILLS = ("oneshot", "agnostic")  # the settings run from one recorded prefill per sample (run_shared)


def make_samples(
    tokenizer: Any,
    haystack: str,
    *,
    tasks: Sequence[str],
    context_tokens: int,
    n: int,
    seed: int = 0,
    questions: int = 1,
) -> list[Sample]:
    """`n` samples per task at one context length; needle depths of the older needle tasks sweep evenly over (0, 1),
    RULER's thirteen draw theirs from the seed as RULER does. Task k of TASKS + RULER_TASKS gets seed + 1000 k.
    `questions`: how many questions RULER's multikey and QA tasks ask over each context (`ruler_tasks`)."""
    from h2o_kv.studies.eval.ruler_tasks import make_ruler_dataset

    depths = [(i + 0.5) / n for i in range(n)]
    tok_len = hf_tokenizer_len(tokenizer)
    samples: list[Sample] = []
    for task in tasks:  # a task's samples do not depend on which other tasks run (kvpress gets the same ones)
        if task in RULER_TASKS:
            samples += make_ruler_dataset(task, n, context_tokens, tokenizer=tokenizer, haystack=haystack,
                                          seed=seed + 1000 * (len(TASKS) + RULER_TASKS.index(task)),
                                          questions=questions)  # fmt: skip
            continue
        depth = depths if task in ("passkey", "niah_single", "niah_multikey") else None
        samples += make_dataset(
            task, n, context_tokens, tokenizer_len=tok_len, haystack=haystack, seed=seed + 1000 * TASKS.index(task),
            depth=depth,
        )  # fmt: skip
    return samples


def answer_tokens(task: str, cap: int | None) -> int:
    """RULER's generation length for `task`, capped (the answers come first; the cap saves time)."""
    n = max_new_tokens(task)
    return n if cap is None else min(n, cap)


def score_batch(tokenizer: Any, samples: Sequence[Sample], outputs: Sequence[Sequence[int]]) -> list[float]:
    """RULER score of each decoded continuation."""
    return [score(s, tokenizer.decode(out, skip_special_tokens=True)) for s, out in zip(samples, outputs, strict=True)]


def mean_by_task(samples: Sequence[Sample], scores: Sequence[float]) -> dict[str, tuple[float, int]]:
    """{task: (mean score, count)} in first-seen task order."""
    acc: dict[str, list[float]] = {}
    for s, v in zip(samples, scores, strict=True):
        acc.setdefault(s.task, []).append(v)
    return {t: (sum(v) / len(v), len(v)) for t, v in acc.items()}


def run_retrieval(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    configs: Sequence[tuple[str, Budget]],
    *,
    prefill: str = "stream",
    chunk: int = 16,
    mode: Mode = "drop",
    gen_cap: int | None = 32,
    progress: Any = None,
) -> list[dict]:
    """One row per (policy, budget, task): the mean RULER score of the samples (all one context length)."""
    if prefill not in ("oneshot", "stream"):
        raise ValueError(f"prefill must be 'oneshot' or 'stream', got {prefill!r}")
    samples = [one for s in samples for one in asked(s)]  # each question with its context: a prompt of its own
    prompt_ids = [c + q for c, q in (split_ids(tokenizer, s) for s in samples)]  # one token sequence per sample
    context = max(s.context_tokens for s in samples)
    new = [answer_tokens(s.task, gen_cap) for s in samples]
    rows = []
    for policy, budget in configs:
        outputs = greedy_generate(
            model,
            tokenizer,
            prompt_ids,
            policy,
            budget,
            max_new_tokens=new,
            mode=mode,
            prefill_chunk=chunk if prefill == "stream" else None,
            length=context,
        )
        for task, (mean, count) in mean_by_task(samples, score_batch(tokenizer, samples, outputs)).items():
            rows.append(
                {"policy": policy, "budget": budget, "length": context, "subtask": task, "score": mean, "n": count}
            )
        if progress is not None:
            progress.update(1)
    return rows


def by_rounds(samples: Sequence[Sample]) -> list[Sample]:
    """Each (task, context)'s first sample, then each one's second, and so on: a run stopped partway (the long ones
    resume across sessions) has every task's first samples, not all of the first tasks'."""
    groups: dict[tuple[str, int], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.task, sample.context_tokens), []).append(sample)
    return [s for row in itertools.zip_longest(*groups.values()) for s in row if s is not None]


def run_shared(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    configs: Sequence[tuple[str, Budget]],
    *,
    cells: Cells,
    mode: Mode = "drop",
    gen_cap: int | None = 32,
    progress: Any = None,
    agnostic: bool = False,
) -> list[dict]:
    """Oneshot rows like `run_retrieval`'s (plus the mean KV bytes kept after the prompt), from one recorded
    prefill per sample replayed into every (policy, budget)'s cache (shared.py); int8 policies run alone.
    `agnostic`: the context is compressed alone and the question fed after it (RULER's thirteen tasks only); a
    sample's several questions are each answered from a fork of its one compressed cache (query-aware: each question
    is a prompt of its own). Scores average over every question, KV bytes over every compressed prompt.

    Each (sample, policy, budget) is a cell of its own, named by the sample's seed, depth and task rather than
    by the study's sizes, so a rerun with more samples, tasks or policies reuses every answer it already has; a
    sample with several questions names their count (and, query-aware, the question), so one-question cells stay valid.
    An answer stops once it holds every gold answer (its score can only stay), at EOS or at the cap. Samples go
    round by round over the tasks (`by_rounds`).
    """
    eos = eos_ids(model, tokenizer)
    context = max(s.context_tokens for s in samples)
    found: dict[tuple[str, Budget], list[tuple[str, list[float], int]]] = {run: [] for run in configs}
    for sample in by_rounds(samples):
        context_ids, question_ids = split_ids(tokenizer, sample)
        if agnostic and not question_ids:
            raise ValueError(f"task {sample.task!r} has no question part: query-agnostic runs RULER's thirteen tasks "
                             f"({', '.join(RULER_TASKS)})")  # fmt: skip
        asks = asked(sample)
        if agnostic:  # the context compressed once, then every question
            jobs = [(context_ids, asks, {"questions": len(asks)} if len(asks) > 1 else {})]
        else:  # each question inside its own compressed prompt
            jobs = [(sum(split_ids(tokenizer, one), []), [one], {"questions": len(asks), "question": i}
                     if len(asks) > 1 else {}) for i, one in enumerate(asks)]  # fmt: skip
        for prompt_ids, ones, tag in jobs:
            for run, rows in _prompt_cells(model, tokenizer, prompt_ids, ones, configs, cells=cells, mode=mode,
                                           gen_cap=gen_cap, eos=eos, context=context, agnostic=agnostic,
                                           tag=tag).items():  # fmt: skip
                found[run].append((sample.task, [r["score"] for r in rows], rows[0]["kv_bytes"]))
        if progress is not None:
            progress.update(1)
    rows = []
    for (policy, budget), results in found.items():
        for task in dict.fromkeys(t for t, _, _ in results):
            scores = [v for t, vs, _ in results if t == task for v in vs]
            kv = [b for t, _, b in results if t == task]
            rows.append({"policy": policy, "budget": budget, "length": context, "subtask": task,
                         "score": sum(scores) / len(scores), "kv_bytes": sum(kv) / len(kv),
                         "n": len(scores)})  # fmt: skip
    return rows


def _prompt_cells(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    asks: list[Sample],
    configs: Sequence[tuple[str, Budget]],
    *,
    cells: Cells,
    mode: Mode,
    gen_cap: int | None,
    eos: set[int],
    context: int,
    agnostic: bool,
    tag: dict,
) -> dict[tuple[str, Budget], list[dict]]:
    """{(policy, budget): one row per question} of one compressed prompt: stored cells reused, the others computed
    together (shared.py). `asks`: the questions answered from it (fed after it when `agnostic`)."""
    sample = asks[0]
    per_sample = bool(sample.question)  # RULER-13: the fraction is of what is compressed, as kvpress sizes it
    length = len(prompt_ids) if per_sample else context
    # RULER-13 as kvpress runs it: what comes after the compressed prompt (the question when agnostic, the answer) is
    # appended to the cache, not made room for by evicting the prompt (`KVCache(headroom=...)`)
    setting = "agnostic" if agnostic else "aware"
    extra = dict(setting=setting, budget_of="compressed", after="appended") if per_sample else {}
    kind = "retrieval-questions" if tag else "retrieval-sample"  # compare/per_sample.py reads one-question cells
    names = {
        run: dict(kind=kind, subtask=sample.task, context=context, depth=sample.depth,
                  sample_seed=sample.metadata["seed"], answer_cap=gen_cap, mode=mode, policy=run[0], budget=run[1],
                  **extra, **tag)
        for run in configs
    }  # fmt: skip
    have = {run: cells.stored(name) for run, name in names.items()}
    questions = [split_ids(tokenizer, one)[1] if agnostic else [] for one in asks]
    new = answer_tokens(sample.task, gen_cap)
    headroom = max(map(len, questions)) + new if per_sample else 0
    makers = {run: partial(new_cache, run[0], run[1], length, mode=mode, headroom=headroom)
              for run in configs if have[run] is None}  # fmt: skip
    if makers:
        stops = [lambda out, s=one: score(s, tokenizer.decode(out, skip_special_tokens=True)) == 1.0 for one in asks]
        answers = shared_answers(model, prompt_ids, makers, questions, max_new_tokens=new, eos=eos, done=stops,
                                 tokenizer=tokenizer)  # fmt: skip
        for run, (outs, kv_bytes) in answers.items():
            have[run] = []
            for i, (one, tokens) in enumerate(zip(asks, outs, strict=True)):
                text = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
                have[run].append({"answer": text, "score": score(one, text), "kv_bytes": kv_bytes}
                                 | ({"question": i} if len(asks) > 1 else {}))  # fmt: skip
            cells.put(names[run], have[run])
    return have

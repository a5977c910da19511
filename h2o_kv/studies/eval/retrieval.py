"""Long-context retrieval with a model: RULER-style samples (built by `ruler.py`), greedy answers, RULER scores.

The budget is resolved against the context length (prompts end just below it). Two prefill settings:
"oneshot" reads the prompt in one call and then evicts (the paper's generation setting: the question's
attention counts when choosing what to keep); "stream" feeds the prompt through the bounded cache in
chunks, so a needle must earn attention before the question arrives to survive. Oneshot runs sample by
sample with one shared prefill for every policy (`run_shared`, shared.py), each (sample, policy, budget)
stored as its own cell; stream runs all samples of a context as one left-padded batch per policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.runtime.generation import eos_ids
from h2o_kv.studies.eval.cells import Cells
from h2o_kv.studies.eval.decoding import greedy_generate, new_cache
from h2o_kv.studies.eval.ruler import TASKS, Sample, hf_tokenizer_len, make_dataset, max_new_tokens, score
from h2o_kv.studies.eval.ruler_fit import split_ids
from h2o_kv.studies.eval.ruler_spec import RULER_TASKS
from h2o_kv.studies.eval.shared import shared_greedy

SHARED_PREFILLS = ("oneshot", "agnostic")  # the settings run from one recorded prefill per sample (run_shared)


def make_samples(
    tokenizer: Any,
    haystack: str,
    *,
    tasks: Sequence[str],
    context_tokens: int,
    n: int,
    seed: int = 0,
) -> list[Sample]:
    """`n` samples per task at one context length; needle depths of the older needle tasks sweep evenly over (0, 1),
    RULER's thirteen draw theirs from the seed as RULER does. Task k of TASKS + RULER_TASKS gets seed + 1000 k."""
    from h2o_kv.studies.eval.ruler_tasks import make_ruler_dataset

    depths = [(i + 0.5) / n for i in range(n)]
    tok_len = hf_tokenizer_len(tokenizer)
    samples: list[Sample] = []
    for task in tasks:  # a task's samples do not depend on which other tasks run (kvpress gets the same ones)
        if task in RULER_TASKS:
            samples += make_ruler_dataset(task, n, context_tokens, tokenizer=tokenizer, haystack=haystack,
                                          seed=seed + 1000 * (len(TASKS) + RULER_TASKS.index(task)))  # fmt: skip
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
    `agnostic`: the context is compressed alone and the question fed after it (RULER's thirteen tasks only).

    Each (sample, policy, budget) is a cell of its own, named by the sample's seed, depth and task rather than
    by the study's sizes, so a rerun with more samples, tasks or policies reuses every answer it already has.
    An answer stops once it holds every gold answer (its score can only stay), at EOS or at the cap.
    """
    eos = eos_ids(model, tokenizer)
    context = max(s.context_tokens for s in samples)
    found: dict[tuple[str, Budget], list[tuple[str, float, int]]] = {run: [] for run in configs}
    for sample in samples:
        context_ids, question_ids = split_ids(tokenizer, sample)
        if agnostic and not question_ids:
            raise ValueError(f"task {sample.task!r} has no question part: query-agnostic runs RULER's thirteen tasks "
                             f"({', '.join(RULER_TASKS)})")  # fmt: skip
        prompt_ids = context_ids if agnostic else context_ids + question_ids
        per_sample = bool(sample.question)  # RULER-13: the fraction is of what is compressed, as kvpress sizes it
        length = len(prompt_ids) if per_sample else context
        extra = dict(setting="agnostic" if agnostic else "aware", budget_of="compressed") if per_sample else {}
        names = {
            run: dict(kind="retrieval-sample", subtask=sample.task, context=context, depth=sample.depth,
                      sample_seed=sample.metadata["seed"], answer_cap=gen_cap, mode=mode, policy=run[0], budget=run[1],
                      **extra)
            for run in configs
        }  # fmt: skip
        have = {run: cells.stored(name) for run, name in names.items()}
        makers = {run: partial(new_cache, run[0], run[1], length, mode=mode) for run in configs if have[run] is None}
        if makers:
            answers = shared_greedy(
                model, prompt_ids, makers, max_new_tokens=answer_tokens(sample.task, gen_cap), eos=eos,
                done=lambda out, s=sample: score(s, tokenizer.decode(out, skip_special_tokens=True)) == 1.0,
                question_ids=question_ids if agnostic else (), tokenizer=tokenizer,
            )  # fmt: skip
            for run, (tokens, kv_bytes) in answers.items():
                text = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
                have[run] = [{"answer": text, "score": score(sample, text), "kv_bytes": kv_bytes}]
                cells.put(names[run], have[run])
        for run in configs:
            found[run].append((sample.task, have[run][0]["score"], have[run][0]["kv_bytes"]))
        if progress is not None:
            progress.update(1)
    rows = []
    for (policy, budget), results in found.items():
        for task in dict.fromkeys(t for t, _, _ in results):
            mine = [(v, b) for t, v, b in results if t == task]
            rows.append({"policy": policy, "budget": budget, "length": context, "subtask": task,
                         "score": sum(v for v, _ in mine) / len(mine), "kv_bytes": sum(b for _, b in mine) / len(mine),
                         "n": len(mine)})  # fmt: skip
    return rows

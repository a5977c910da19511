"""Long-context retrieval with a model: RULER-style samples (built by `ruler.py`), greedy answers, RULER scores.

All samples of one context length run as one left-padded batch per (policy, budget), whatever the
task. The budget is resolved against the context length (prompts end just below it). Two prefill
settings: "oneshot" reads the prompt in one call and then evicts (the paper's generation setting: the
question's attention counts when choosing what to keep); "stream" feeds the prompt through the
bounded cache in chunks, so a needle must earn attention before the question arrives to survive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.studies.eval.decoding import greedy_generate
from h2o_kv.studies.eval.fidelity import encode
from h2o_kv.studies.eval.ruler import TASKS, Sample, hf_tokenizer_len, make_dataset, max_new_tokens, score


def make_samples(
    tokenizer: Any,
    haystack: str,
    *,
    tasks: Sequence[str],
    context_tokens: int,
    n: int,
    seed: int = 0,
) -> list[Sample]:
    """`n` samples per task at one context length; needle depths sweep evenly over (0, 1)."""
    depths = [(i + 0.5) / n for i in range(n)]
    tok_len = hf_tokenizer_len(tokenizer)
    samples: list[Sample] = []
    for task in tasks:  # a task's samples do not depend on which other tasks run (kvpress gets the same ones)
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
    prompt_ids = encode(tokenizer, [s.prompt for s in samples])
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

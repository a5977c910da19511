"""Accuracy evaluation for bounded-KV-cache generation (`h2o-kv eval`).

Budgets mean what they mean everywhere in h2o-kv: an int is tokens per (sequence, KV head), a float
in (0, 1] a fraction; here the fraction is of the evaluated length (the window, context or longest
prompt of a task), resolved with `policies.budget_tokens(budget, length)` and built with
`policies.build`, so every sequence of a task keeps the same number of tokens.

Files: run (orchestration, `run_eval`), sizes (presets), perplexity, retrieval (runs the RULER-style
tasks that ruler / ruler_build generate, and RULER's thirteen from ruler_tasks: ruler_spec, ruler_fit,
ruler_niah, ruler_words, ruler_qa, ruler_vocab), shared (one recorded prefill for every policy), fidelity,
summarize, decoding (batched greedy and teacher-forced loops), metrics, tables (rows, CSV/JSON,
summary.md), plots, cli, lm_eval_adapter.
Importing this package needs only the core's dependencies; running it needs the `eval` extra.
"""

from __future__ import annotations

from h2o_kv.policies import parse_budget

__all__ = ["parse_budgets", "run_eval"]


def parse_budgets(text: str) -> list[float | int]:
    """ "0.05,0.1,0.2,0.5" -> fractions; "64,128" -> token counts ("5%" is 0.05), each by `parse_budget`."""
    budgets = [parse_budget(item) for item in str(text).split(",") if item.strip()]
    if not budgets:
        raise ValueError(f"no budgets in {text!r}: give tokens (64,128) or fractions (0.1,0.2)")
    return budgets


def run_eval(*args, **kwargs):
    """Run the accuracy evaluation (see `h2o_kv.studies.eval.run.run_eval`)."""
    from h2o_kv.studies.eval.run import run_eval as _run

    return _run(*args, **kwargs)

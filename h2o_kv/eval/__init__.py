"""Accuracy evaluation for bounded-KV-cache generation: synthetic retrieval tasks and text metrics.

Budgets everywhere are either a fraction of the evaluated length (a float in (0, 1], the paper's
5/10/20/50 %) or a token count (an int >= 1); `budget_tokens` and `make_policy` turn them into a
policy for one sequence length, so every task sizes its cache the same way. The runner behind
``h2o-kv eval`` is `h2o_kv.eval.runner.run_eval`.
"""

from __future__ import annotations

from h2o_kv.policies import Budget, Full, Policy, budget_tokens, build, is_fraction

__all__ = ["Budget", "budget_tokens", "is_fraction", "make_policy", "parse_budgets", "run_eval"]


def make_policy(name: str, budget: Budget, length: int) -> Policy:
    """The policy `name` ("h2o", "local", "streamingllm", "tova", "full") at `budget` for `length` tokens.

    H2O splits its tokens evenly between heavy hitters and the recent window (the paper's 50/50);
    StreamingLLM keeps 4 sink tokens (fewer when the budget is tiny) and a window of the rest.
    """
    tokens = budget_tokens(budget, length)
    if name.lower() == "full" or tokens is None:
        return Full()
    return build(name, tokens)


def parse_budgets(text: str | list | tuple) -> list[float | int]:
    """ "0.05,0.1,0.2,0.5" -> fractions; "64,128" -> token counts ("5%" also reads as 0.05)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[float | int] = []
    for item in items:
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            out.append(item)
            continue
        s = str(item).strip()
        if not s:
            continue
        if s.endswith("%"):
            out.append(float(s[:-1]) / 100)
        elif "." in s or "e" in s.lower():
            out.append(float(s))
        else:
            out.append(int(s))
    for b in out:
        budget_tokens(b, 1)  # validates
    return out


def run_eval(*args, **kwargs):
    """Run the accuracy evaluation (see `h2o_kv.eval.runner.run_eval`)."""
    from .runner import run_eval as _run

    return _run(*args, **kwargs)

"""Fitting a RULER sample to a token length with the model's tokenizer, and the sample's token ids.

RULER's ``max_seq_length`` holds the prompt and the generated answer, so a sample's context is sized until context +
question (with its answer prefix) + the task's generation length is just below the length. The context is tokenized
with the tokenizer's special tokens (a BOS where the model has one), the question after it without: the query-aware
prompt is exactly the context's ids followed by the question's (`split_ids`), the ids query-agnostic feeds in two
calls, and the ids kvpress receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from h2o_kv.studies.eval.ruler_build import _fit

Built = tuple[str, str, list[str], dict[str, Any]]  # context, question + answer prefix, gold answers, metadata


class Fitter:
    """Sizes contexts for one sample: `fit` finds the largest haystack whose context leaves room for the question and
    `generate` answer tokens within `length` tokens."""

    def __init__(self, tokenizer: Any, length: int, generate: int) -> None:
        if length <= generate:
            raise ValueError(f"the length ({length} tokens) must exceed the answer's {generate} tokens")
        self.tokenizer, self.length, self.generate = tokenizer, length, generate
        self.context_tokens = self.question_tokens = 0

    def context_len(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def question_len(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def fit(
        self, render: Callable[[int], str], question: str, unit_tokens: float, max_units: int | None = None
    ) -> tuple[int, str]:
        """(units, context) of the largest `render(units)` that fits beside `question` (`ruler_build._fit`)."""
        self.question_tokens = self.question_len(question)
        room = self.length - self.generate - self.question_tokens
        fixed = self.context_len(render(0))
        if fixed > room:
            raise ValueError(f"{self.length} tokens are too few for this task: without haystack its context has "
                             f"{fixed}, its question {self.question_tokens}, its answer {self.generate}")  # fmt: skip
        n, context, tokens = _fit(render, self.context_len, room, max(unit_tokens, 1e-3), max_units)
        self.context_tokens = tokens
        return n, context


def split_ids(tokenizer: Any, sample: Any) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of a sample: a RULER-13 sample's two parts as `Fitter` counted them; an older task
    (no split) is its whole prompt, encoded as the retrieval runner always has, with no question part."""
    if not sample.question:
        return list(tokenizer(sample.prompt)["input_ids"]), []
    context = tokenizer(sample.context, add_special_tokens=True)["input_ids"]
    return list(context), list(tokenizer(sample.question, add_special_tokens=False)["input_ids"])

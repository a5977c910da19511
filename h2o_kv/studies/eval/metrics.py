"""Text and token metrics for comparing bounded-KV-cache generations against references.

Everything here is pure Python so it can score generations without a model: ROUGE-L (F1) over words or
token ids, and how many leading tokens a generation shares with the full cache's.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

__all__ = ["agreement_until_divergence", "lcs_length", "rouge_l", "rouge_l_tokens"]

_WORD_RE = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    """Lower-cased word tokens; punctuation and whitespace both act as separators."""
    return _WORD_RE.findall(text.lower())


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b``.

    Classic O(len(a) * len(b)) dynamic programme, but with a single rolling row of ints so memory is
    O(min(len(a), len(b))): generations of a few hundred tokens stay cheap.
    """
    if len(a) < len(b):
        a, b = b, a  # keep the row over the shorter sequence
    if not b:
        return 0
    row = [0] * (len(b) + 1)
    for x in a:
        diag = 0  # row[j-1] of the previous row
        for j, y in enumerate(b, start=1):
            up = row[j]
            if x == y:
                row[j] = diag + 1
            elif row[j - 1] > up:
                row[j] = row[j - 1]
            diag = up
    return row[-1]


def rouge_l_tokens(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """ROUGE-L F1 between two token sequences (e.g. generated token ids).

    With beta = 1, F1 = 2 * LCS / (len(a) + len(b)), so the metric is symmetric. Two empty sequences
    are identical and score 1.0; one empty sequence scores 0.0.
    """
    if not a and not b:
        return 1.0
    if not a or not b:
        return 0.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased word tokens (whitespace and punctuation split words).

    No stemming or stop-word removal, so results are reproducible without extra packages; they can
    differ slightly from the ``rouge-score`` package, which applies a Porter stemmer when asked.
    """
    return rouge_l_tokens(_words(prediction), _words(reference))


def agreement_until_divergence(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token.

    This is the usual "how long does the compressed-cache generation follow the full-cache one" number:
    after the first differing token, greedy decoding conditions on different prefixes, so later
    matches are not comparable. Pass plain lists (``tensor.tolist()``) rather than tensors.
    """
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

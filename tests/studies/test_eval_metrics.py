"""Hand-checked cases for the text/token metrics in h2o_kv.studies.eval.metrics."""

from __future__ import annotations

import random
from functools import cache

import pytest

from h2o_kv.studies.eval.metrics import agreement_until_divergence, lcs_length, rouge_l, rouge_l_tokens


def _lcs_reference(a: tuple, b: tuple) -> int:
    """Plain recursive LCS, the textbook definition, to cross-check the rolling-row version."""

    @cache
    def go(i: int, j: int) -> int:
        if i == len(a) or j == len(b):
            return 0
        if a[i] == b[j]:
            return 1 + go(i + 1, j + 1)
        return max(go(i + 1, j), go(i, j + 1))

    return go(0, 0)


def test_rouge_l_identical_is_one() -> None:
    assert rouge_l("the cat sat", "the cat sat") == 1.0


def test_rouge_l_hand_computed_partial() -> None:
    # pred: the cat sat on the mat (6) / ref: the cat lay on a mat (6); LCS = the cat on mat = 4
    # P = R = 4/6 -> F1 = 2/3
    assert rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 / 3)
    # Order matters: LCS("police killed the gunman", "the gunman police killed") = 2 -> F1 = 2*2/8
    assert rouge_l("police killed the gunman", "the gunman police killed") == pytest.approx(0.5)
    # Unequal lengths: pred "a b" vs ref "a x b y z": LCS 2, P = 1, R = 2/5 -> F1 = 2*1*0.4/1.4
    assert rouge_l("a b", "a x b y z") == pytest.approx(2 * 1 * 0.4 / 1.4)


def test_rouge_l_ignores_case_and_punctuation() -> None:
    assert rouge_l("The cat, sat!", "the   cat sat") == 1.0
    assert rouge_l("dog", "cat") == 0.0


def test_rouge_l_empty_conventions() -> None:
    assert rouge_l("", "") == 1.0
    assert rouge_l("", "something") == 0.0
    assert rouge_l("...", "word") == 0.0  # punctuation only -> no tokens


def test_rouge_l_tokens_on_ids() -> None:
    # LCS([1,2,3,4],[1,3,4,5]) = [1,3,4] -> 2*3/8
    assert rouge_l_tokens([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l_tokens((7, 7, 7), [7, 7, 7]) == 1.0
    assert rouge_l_tokens([1, 2], [3, 4]) == 0.0


def test_lcs_matches_reference_on_random_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        a = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 9)))
        b = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 9)))
        assert lcs_length(a, b) == _lcs_reference(a, b), (a, b)
        assert lcs_length(b, a) == lcs_length(a, b)


def test_agreement_until_divergence() -> None:
    assert agreement_until_divergence([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert agreement_until_divergence([1, 2, 3], [1, 2, 3, 9, 9]) == 3
    assert agreement_until_divergence([5, 2, 3], [1, 2, 3]) == 0
    assert agreement_until_divergence([], [1]) == 0

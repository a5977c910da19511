"""RULER's variable tracking (``vt``), common words (``cwe``) and frequent words (``fwe``), each with RULER's settings.

Written anew after RULER's ``variable_tracking.py``, ``common_words_extraction.py`` and ``freq_words_extraction.py``:

* vt: chains "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", ... scattered through the repeated noise paragraph, after
  one worked example (3-letter names, fitted to 500 tokens, with its answer) as RULER's few-shot; the answer is every
  variable of the chain that holds the asked value.
* cwe: a numbered list where ten words appear 30 times and the others 3 (6 and 1 below 4,096 tokens, as RULER), after
  a worked 40-word example; the vocabulary is wonderwords' nouns, adjectives and verbs (RULER's).
* fwe: six-letter coded words with Zipf counts (alpha 2) over ``length // 50`` words, the most frequent one replaced by
  "..." (noise); the answer is the next three.
"""

from __future__ import annotations

import random
import string

from h2o_kv.studies.eval.ruler_fit import Built, Fitter
from h2o_kv.studies.eval.ruler_niah import NOISE
from h2o_kv.studies.eval.ruler_vocab import Words

_VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
              "the value {value}, they are: ")  # fmt: skip
_CWE_HEADER = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.")  # fmt: skip
_CWE_QUESTION = "Question: What are the {k} most common words in the above list?"
_CWE_PREFIX = " Answer: The top {k} words that appear most often in the list are:"
_FWE_HEADER = ("Read the following coded text and track the frequency of each coded word. "
               "Find the three most frequently appeared coded words.")  # fmt: skip
_FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                 "What are the three most frequently appeared words in the above coded text?")  # fmt: skip
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def _names(rng: random.Random, n: int, letters: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def _vt_parts(rng: random.Random, chains: int, hops: int, letters: int, taken: set[str]):
    """The chains' statements with their depths, the asked value and the gold names."""
    names = _names(rng, chains * (hops + 1), letters, taken)
    items, values = [], []
    for c in range(chains):
        vs = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        values.append(str(rng.randint(10000, 99999)))
        stmts = [f"VAR {vs[0]} = {values[-1]}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]}" for j in range(hops)]
        depths = sorted(rng.random() for _ in stmts)
        items += [(d, c * (hops + 1) + j, s) for j, (d, s) in enumerate(zip(depths, stmts))]
    return items, values[0], names[: hops + 1]


def _vt_body(items: list, n: int) -> str:
    """`n` noise paragraphs with each statement before paragraph int(depth * n), in chain order."""
    out: list[str] = []
    ordered = sorted((int(d * n), order, s) for d, order, s in items)
    k = 0
    for i in range(n + 1):
        while k < len(ordered) and ordered[k][0] <= i:
            out.append(ordered[k][2])
            k += 1
        if i < n:
            out.append(NOISE + "\n")
    return " ".join(out).replace(". \n", ".\n")


def _vt_text(rng, fitter: Fitter, chains: int, hops: int, letters: int, taken: set[str], prefix_text: str = ""):
    items, value, gold = _vt_parts(rng, chains, hops, letters, taken)
    question = _VT_QUESTION.format(value=value)
    prefix = _VT_PREFIX.format(n=hops + 1, value=value)
    n, context = fitter.fit(lambda n: f"{prefix_text}{_VT_HEADER}\n\n{_vt_body(items, n)}\n", question + prefix,
                            fitter.context_len(NOISE + "\n"))  # fmt: skip
    return context, question, prefix, gold, value, n


def vt(rng: random.Random, fitter: Fitter, haystack: str, words: Words, *, chains: int, hops: int) -> Built:
    """Variable tracking after one worked example (RULER's few-shot: it fits 500 tokens, its names have 3 letters)."""
    taken: set[str] = set()
    example_fit = Fitter(fitter.tokenizer, 500, fitter.generate)
    e_ctx, e_q, e_prefix, e_gold, _, _ = _vt_text(rng, example_fit, chains, min(10, hops), 3, taken)
    example = f"{e_ctx}{e_q}{e_prefix}{' '.join(e_gold)}\n\n\n\n"
    context, question, prefix, gold, value, n = _vt_text(rng, fitter, chains, hops, 5, taken, example)
    meta = {"answer_prefix": prefix, "question_only": question, "query_value": value, "noise_paragraphs": n,
            "example_answer": e_gold}  # fmt: skip
    return context, question + prefix, gold, meta


def _cwe_list(words: list[str], common: int, freq_cw: int, freq_ucw: int, seed: int) -> str:
    items = words[:common] * freq_cw + words[common:] * freq_ucw
    random.Random(seed).shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


def cwe(rng: random.Random, fitter: Fitter, haystack: str, words: Words, *, freq_cw: int, freq_ucw: int,
        num_cw: int) -> Built:  # fmt: skip
    """Common words after a worked example; the answer is the `num_cw` words repeated `freq_cw` times."""
    vocab = words.common
    rng.shuffle(vocab)
    if fitter.length < 4096:  # RULER's short-context setting: the long one's counts do not fit
        (e_cw, e_ucw), (freq_cw, freq_ucw), e_words = (3, 1), (6, 1), 20
    else:
        (e_cw, e_ucw), e_words = (10, 3), 40
    if len(vocab) < e_words + num_cw + 1:
        raise ValueError(f"cwe needs more than {e_words + num_cw} distinct words, got {len(vocab)}")
    example_words, pool = vocab[-e_words:], vocab[:-e_words]
    question = _CWE_QUESTION.format(k=num_cw)
    prefix = _CWE_PREFIX.format(k=num_cw)
    answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[:num_cw]))
    example = _cwe_list(example_words, num_cw, e_cw, e_ucw, rng.getrandbits(64))
    head = f"{_CWE_HEADER}\n{example}\n{question}{prefix} {answer}\n{_CWE_HEADER}\n"
    seed = rng.getrandbits(64)
    unit = fitter.context_len(" ".join(f"{100 + i}. {w}" for i, w in enumerate(pool[:200]))) / 200 * freq_ucw
    n, context = fitter.fit(lambda n: f"{head}{_cwe_list(pool[: num_cw + n], num_cw, freq_cw, freq_ucw, seed + n)}\n",
                            question + prefix, unit, max_units=len(pool) - num_cw)  # fmt: skip
    if n == len(pool) - num_cw and fitter.length - fitter.context_tokens - fitter.question_tokens > fitter.length // 10:
        raise ValueError(f"cwe: {len(vocab)} distinct words cannot fill {fitter.length} tokens")
    meta = {"answer_prefix": prefix, "question_only": question, "common_freq": freq_cw, "uncommon_freq": freq_ucw,
            "num_uncommon": n, "example_answer": example_words[:num_cw]}  # fmt: skip
    return context, question + prefix, pool[:num_cw], meta


def _zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha) for alpha > 1: the partial sum plus its Euler-Maclaurin tail (error below 1e-9 at 2.0)."""
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


def fwe(rng: random.Random, fitter: Fitter, haystack: str, words: Words, *, alpha: float, word_len: int) -> Built:
    """Frequent coded words: word k of `length // 50` appears int(n k^-alpha / zeta(alpha)) times; word 1 is '...'."""
    if alpha <= 1:
        raise ValueError(f"fwe's alpha must exceed 1, got {alpha}")
    size = max(5, fitter.length // 50)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    coded = sorted(vocab)
    rng.shuffle(coded)
    coded[0] = "..."  # RULER treats the most frequent word as noise
    z, seed = _zeta(alpha), rng.getrandbits(64)

    def text(n: int) -> str:
        items = [w for k, w in enumerate(coded, 1) for _ in range(int(n * k**-alpha / z))]
        random.Random(seed + n).shuffle(items)
        return " ".join(items)

    question, prefix = _FWE_QUESTION, _FWE_PREFIX
    unit = fitter.context_len(text(2000)) / 2000
    n, context = fitter.fit(lambda n: f"{_FWE_HEADER} {text(n)}\n", question + prefix, unit)
    counts = [int(n * k**-alpha / z) for k in range(1, 6)]
    if not counts[1] > counts[2] > counts[3] > counts[4]:
        raise ValueError(f"fwe at {fitter.length} tokens is too short for a clear top three (counts {counts})")
    meta = {"answer_prefix": prefix, "question_only": question, "alpha": alpha, "num_words": n, "counts": counts[:4]}
    return context, question + prefix, coded[1:4], meta

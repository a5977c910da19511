"""RULER's eight needle-in-a-haystack tasks (``niah_*``): one generator, three haystacks, keys and values by kind.

As RULER's ``niah.py`` (written anew here): needles "One of the special magic {numbers|uuids} for {key} is: {value}."
go into a haystack that is the repeated noise paragraph ("repeat"), running text ("essay": the caller's corpus, h2o-kv's
Shakespeare, where RULER has Paul Graham's essays) or other needles ("needle": random keys and values). Keys are
"adjective-noun" words (wonderwords' lists, as RULER) or UUIDs; values 7-digit numbers or UUIDs. ``keys`` needles with
``values`` values each; ``queries`` of the keys are asked, and the answer is every value of every asked key. With one
value asked the template is RULER's singular one ("A special magic number ... is").

``questions=k`` (k > 1, one asked key): k questions over one context, each about its own needle's key (the asked one
first, then the other needles in order; needles added, drawn after RULER's, up to k), each gold that needle's values.
The context is fitted beside the longest question; the header stays the one-question header.
"""

from __future__ import annotations

import random
import uuid

from h2o_kv.studies.eval.ruler_build import Filler, _insert
from h2o_kv.studies.eval.ruler_fit import Built, Fitter
from h2o_kv.studies.eval.ruler_vocab import Words

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 needle depths (percent) for the essay haystack
_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_HEADER = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
           "I will quiz you about the {kind} afterwards.")  # fmt: skip
_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
_HEADER_1 = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {kind} afterwards.")  # fmt: skip
_QUESTION_1 = "What is the special magic {kind} for {query} mentioned in the provided text?"
_PREFIX_1 = " The special magic {kind} for {query} mentioned in the provided text is"


def random_of(rng: random.Random, kind: str, words: Words) -> str:
    """A key or value of `kind`: "numbers" (7 digits), "words" (adjective-noun) or "uuids"."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(words.adjectives)}-{rng.choice(words.nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle kind must be numbers, words or uuids, got {kind!r}")


def _fresh(rng: random.Random, kind: str, words: Words, taken: set[str]) -> str:
    for _ in range(10_000):
        v = random_of(rng, kind, words)
        if v not in taken:
            taken.add(v)
            return v
    raise ValueError(f"cannot draw a new {kind} key: the word lists are too small")


class _Needles:
    """The 'needle' haystack: distractor needles drawn one after another from their own seed, so the first n are the
    same whatever n is (the fit tries several n)."""

    def __init__(self, seed: int, key: str, value: str, kind: str, words: Words, taken: set[str]) -> None:
        self.rng, self.key, self.value, self.kind = random.Random(seed), key, value, kind
        self.words, self.taken = words, taken
        self.lines: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self.lines) < n:
            key = _fresh(self.rng, self.key, self.words, self.taken)
            value = random_of(self.rng, self.value, self.words)
            self.lines.append(_NEEDLE.format(kind=self.kind, key=key, value=value))
        return self.lines[:n]


def niah(rng: random.Random, fitter: Fitter, haystack: str, words: Words, *, haystack_kind: str, key: str, value: str,
         keys: int, values: int, queries: int, questions: int = 1) -> Built:  # fmt: skip
    """One NIAH sample fitted by `fitter`: (context, question, answer prefix, golds, metadata); with `questions` > 1
    the metadata's "questions" holds each (question + prefix, golds)."""
    if questions > 1 and queries != 1:
        raise ValueError(f"several questions ask one key each; this task asks {queries} keys at once")
    keys = max(keys, queries)  # as RULER: every asked key has a needle
    taken: set[str] = set()
    key_list = [_fresh(rng, key, words, taken) for _ in range(keys)]
    gold: set[str] = set()
    value_lists = [[_fresh(rng, value, words, gold) for _ in range(values)] for _ in key_list]
    asked = sorted(rng.sample(range(keys), queries))
    for _ in range(questions - keys):  # a needle for each further question, drawn after RULER's draws
        key_list.append(_fresh(rng, key, words, taken))
        value_lists.append([_fresh(rng, value, words, gold) for _ in range(values)])
    kind = value  # the needle names its values' kind in the plural, as RULER's does
    needles = [_NEEDLE.format(kind=kind, key=k, value=v) for k, vs in zip(key_list, value_lists) for v in vs]
    names = [key_list[i] for i in asked]
    answers = [v for i in asked for v in value_lists[i]]
    one = len(answers) == 1
    shown = kind[:-1] if one else kind
    header = (_HEADER_1 if one else _HEADER).format(kind=shown)

    def ask(names: list[str]) -> str:
        query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
        return (_QUESTION_1 if one else _QUESTION).format(kind=shown, query=query)

    def answer_prefix(names: list[str]) -> str:
        query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
        return (_PREFIX_1 if one else _PREFIX).format(kind=shown, query=query)

    question, prefix = ask(names), answer_prefix(names)
    others = [i for i in range(len(key_list)) if i not in asked][: questions - 1]
    asks = [(question + prefix, answers)] + [
        (ask([key_list[i]]) + answer_prefix([key_list[i]]), list(value_lists[i])) for i in others
    ]
    if haystack_kind == "essay":
        filler = Filler(haystack, rng)
        depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))]

        def body(n: int) -> str:
            items = [(filler.snap(d, n), i, nd) for i, (d, nd) in enumerate(zip(depths, needles))]
            return _insert(filler.take(n), items)

        unit = filler.tokens_per_word(fitter.context_len)
    elif haystack_kind in ("repeat", "needle"):
        depths = [rng.random() for _ in needles]
        if haystack_kind == "repeat":
            lines = lambda n: [NOISE] * n  # noqa: E731
            sample_line = NOISE
        else:
            pool = _Needles(rng.getrandbits(64), key, value, kind, words, taken | gold)
            lines = pool.take
            sample_line = "\n".join(pool.take(20))
        unit = fitter.context_len(sample_line) / (20 if haystack_kind == "needle" else 1)

        def body(n: int) -> str:
            out = list(lines(n))
            for d, nd in sorted(zip(depths, needles), key=lambda x: -x[0]):  # from the back, so indexes hold
                out.insert(int(d * n), nd)
            return "\n".join(out)
    else:
        raise ValueError(f"haystack must be repeat, essay or needle, got {haystack_kind!r}")
    longest = max((q for q, _ in asks), key=fitter.question_len) if questions > 1 else asks[0][0]  # room for each
    n, context = fitter.fit(lambda n: f"{header}\n{body(n)}\n", longest, unit)
    meta = {"answer_prefix": prefix, "question_only": question, "haystack": haystack_kind, "keys": key_list,
            "values": value_lists, "asked": names, "needle_depths": depths, "haystack_units": n}  # fmt: skip
    if questions > 1:
        meta |= {"questions": asks, "questions_asked": [names[0]] + [key_list[i] for i in others]}
    return context, question + prefix, answers, meta

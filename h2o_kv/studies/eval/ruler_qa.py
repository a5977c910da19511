"""Synthetic stand-ins for RULER's two QA tasks (SQuAD and HotpotQA cannot be fetched offline): ``qa_1``, ``qa_2``.

No PyPI package found ships SQuAD- or HotpotQA-style question/context/answer data, so the tasks are rebuilt from
the corpus h2o-kv already uses. RULER's format is kept: numbered documents ("Document 3:\\n..."), its instruction
before and after them, "Question: ..." and the answer prefix " Answer:", scored by RULER's ``string_match_part``. The
documents are ~80-word Shakespeare passages; a few of them carry one invented fact each (a book's author, a person's
home town, a company's founder: names made of wonderwords' words, so the model cannot know them beforehand).

* qa_1 (single fact, SQuAD's role): the question asks for one fact's object ("Who wrote the book The Brave Lantern?");
  the other fact documents hold facts of the same kinds about other names, so the words of the question must be matched.
* qa_2 (two facts, HotpotQA's bridge questions): "In which town was the author of The Brave Lantern born?" needs the
  author fact and the home-town fact of that author, in two documents; distractor authors have home towns too.

``questions=k`` (k > 1): k questions over one context, each with its own gold fact (qa_1) or fact pair (qa_2), drawn
after the one-question sample's facts and distractors; the context is fitted beside the longest question.

These are retrieval-heavy reading tests, easier than SQuAD/HotpotQA's paraphrased questions; tables label them
"(synthetic)" (`ruler_spec.label`) and they are not comparable with published qa_1/qa_2 numbers.
"""

from __future__ import annotations

import random

from h2o_kv.studies.eval.ruler_build import _SENTENCE_END_RE, Filler
from h2o_kv.studies.eval.ruler_fit import Built, Fitter
from h2o_kv.studies.eval.ruler_vocab import Words

_INSTRUCTION = ("Answer the question based on the given documents. "
                "Only give me the answer and do not output any other words.")  # fmt: skip
_DOC_WORDS = 80
_FIRST = ("Ada Alma Anton Bruno Clara Dora Edith Elias Felix Greta Hugo Ida Iris Jonas Klara Lena Lotte Magnus Mira "
          "Nils Olga Oskar Paula Rosa Silas Tilda Ugo Vera Viktor Wanda").split()  # fmt: skip
_TOWN_ENDS = ("wick", "bury", "ham", "stead", "mouth", "ford", "field", "by")
_NAME_ENDS = ("son", "ley", "worth", "well", "ton", "more")
# kind: (statement, single-fact question, answer slot); "a" is the subject slot, "b" the object slot
_FACTS = {
    "author": ("{a} is a book written by {b}.", "Who wrote the book {a}?"),
    "home": ("{a} was born in the town of {b}.", "In which town was {a} born?"),
    "founder": ("The {a} company was founded by {b}.", "Who founded the {a} company?"),
}
_BRIDGE = {  # (first fact's kind, question); the second fact is the first's object's home town
    "author": "In which town was the author of the book {a} born?",
    "founder": "In which town was the founder of the {a} company born?",
}


class _Names:
    """Invented names, never repeated within a sample: people, towns, book titles, companies."""

    def __init__(self, rng: random.Random, words: Words) -> None:
        self.rng, self.words, self.taken = rng, words, set()

    def _new(self, make) -> str:
        for _ in range(10_000):
            name = make()
            if name not in self.taken:
                self.taken.add(name)
                return name
        raise ValueError("qa: the word lists are too small to invent distinct names")

    def of(self, kind: str) -> str:
        r, w = self.rng, self.words
        makers = {
            "person": lambda: f"{r.choice(_FIRST)} {r.choice(w.nouns).capitalize()}{r.choice(_NAME_ENDS)}",
            "town": lambda: f"{r.choice(w.nouns).capitalize()}{r.choice(_TOWN_ENDS)}",
            "book": lambda: f"The {r.choice(w.adjectives).capitalize()} {r.choice(w.nouns).capitalize()}",
            "company": lambda: f"{r.choice(w.adjectives).capitalize()} {r.choice(w.nouns).capitalize()}",
        }
        return self._new(makers[kind])

    def fact(self, kind: str, obj: str | None = None) -> tuple[str, str, str]:
        """(statement, subject, object) of a new fact of `kind` (`obj` given: about that person)."""
        subject = self.of({"author": "book", "home": "person", "founder": "company"}[kind]) if obj is None else obj
        value = self.of("town" if kind == "home" else "person")
        return _FACTS[kind][0].format(a=subject, b=value), subject, value


def _facts(
    rng: random.Random, names: _Names, hops: int, distractors: int, questions: int = 1
) -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """(fact statements, (question, answer) of each question, indexes of the gold facts) for one sample: the first
    question's facts, the distractors, then each further question's facts."""
    asks, gold = [], []
    if hops == 1:
        kind = rng.choice(sorted(_FACTS))
        statement, subject, answer = names.fact(kind)
        facts, asks, gold = [statement], [(_FACTS[kind][1].format(a=subject), answer)], [0]
        for i in range(distractors):
            facts.append(names.fact((kind, rng.choice(sorted(_FACTS)))[i % 2])[0])
        for _ in range(questions - 1):
            other = rng.choice(sorted(_FACTS))
            statement, subject, answer = names.fact(other)
            gold.append(len(facts))
            facts.append(statement)
            asks.append((_FACTS[other][1].format(a=subject), answer))
        return facts, asks, gold
    kind = rng.choice(sorted(_BRIDGE))
    first, subject, person = names.fact(kind)
    second, _, answer = names.fact("home", person)
    facts, asks, gold = [first, second], [(_BRIDGE[kind].format(a=subject), answer)], [0, 1]
    while len(facts) < 2 + distractors:  # other people of the same kind, each with a home town
        other, _, someone = names.fact(kind)
        facts.append(other)
        if len(facts) < 2 + distractors:
            facts.append(names.fact("home", someone)[0])
    for _ in range(questions - 1):
        bridge = rng.choice(sorted(_BRIDGE))
        first, subject, person = names.fact(bridge)
        second, _, answer = names.fact("home", person)
        gold += [len(facts), len(facts) + 1]
        facts += [first, second]
        asks.append((_BRIDGE[bridge].format(a=subject), answer))
    return facts, asks, gold


def qa(rng: random.Random, fitter: Fitter, haystack: str, words: Words, *, hops: int, questions: int = 1) -> Built:
    """One synthetic QA sample: documents of corpus passages, a few carrying a fact, fitted by `fitter`; with
    `questions` > 1 the metadata's "questions" holds each (question + prefix, golds)."""
    if hops not in (1, 2):
        raise ValueError(f"qa takes 1 or 2 hops, got {hops}")
    distractors = max(2, min(6, fitter.length // 700))
    facts, pairs, gold = _facts(rng, _Names(rng, words), hops, distractors, questions)
    filler = Filler(haystack, rng)
    slots = [rng.random() for _ in facts]  # where each fact document goes among the plain ones
    at = [rng.random() for _ in facts]  # where within its passage the fact goes

    def passage(i: int, fact: str | None, where: float) -> str:
        words_ = filler.take((i + 1) * _DOC_WORDS)[i * _DOC_WORDS :]
        if fact is not None:
            ends = [j + 1 for j, w in enumerate(words_[:-1]) if _SENTENCE_END_RE.search(w)] or [len(words_)]
            cut = ends[min(int(where * len(ends)), len(ends) - 1)]
            words_ = words_[:cut] + [fact] + words_[cut:]
        return " ".join(words_)

    def render(n: int) -> str:
        order = sorted([(int(s * (n + 1)), 0, j) for j, s in enumerate(slots)] + [(i, 1, -1) for i in range(n)])
        docs = [passage(i, facts[j] if j >= 0 else None, at[j] if j >= 0 else 0.0) for i, (_, _, j) in enumerate(order)]
        body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return f"{_INSTRUCTION}\n\nThe following are given documents.\n\n{body}\n\n"

    prefix = " Answer:"
    asks = [(f"{_INSTRUCTION}\n\nQuestion: {text}{prefix}", [answer]) for text, answer in pairs]
    question = asks[0][0].removesuffix(prefix)
    unit = fitter.context_len(passage(0, None, 0.0)) + 6
    longest = max((q for q, _ in asks), key=fitter.question_len) if questions > 1 else asks[0][0]  # room for each
    n, context = fitter.fit(render, longest, unit)
    meta = {"answer_prefix": prefix, "question_only": question, "facts": facts, "gold_facts": gold,
            "documents": n + len(facts), "substitute": "synthetic QA (not SQuAD/HotpotQA)"}  # fmt: skip
    if questions > 1:
        meta["questions"] = asks
    return context, asks[0][0], asks[0][1], meta

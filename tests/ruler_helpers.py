"""What the RULER task tests share: offline word lists and a play-like haystack (no PyPI fetch)."""

from __future__ import annotations

import random

from h2o_kv.studies.eval.ruler_vocab import Words

_rng = random.Random(5)
_SYL = "ba ko ri mu sel dan tor vi pe lun gar os fi mer tha".split()
WORDS = Words(
    nouns=tuple(dict.fromkeys("".join(_rng.choices(_SYL, k=3)) for _ in range(600))),
    adjectives=tuple(dict.fromkeys("".join(_rng.choices(_SYL, k=2)) + "y" for _ in range(80))),
    verbs=tuple(dict.fromkeys("".join(_rng.choices(_SYL, k=2)) + "ed" for _ in range(80))),
)
_PLAIN = ("the king rode out at dawn with his men and the queen watched from the tower while the river ran past the "
          "walls of the old town where the people sang of war and of peace and of the long winter").split()  # fmt: skip
_SENTENCES = [" ".join(_rng.choices(_PLAIN, k=_rng.randint(5, 12))).capitalize() + "." for _ in range(800)]
HAYSTACK = "\n".join(" ".join(_SENTENCES[i : i + 4]) for i in range(0, len(_SENTENCES), 4))  # a play-like text

"""RULER's thirteen tasks as data: which generator, its settings, its generation length and its metric.

The settings are RULER's ``synthetic.yaml`` (NVIDIA/RULER, Hsieh et al. 2024, arXiv 2404.06654); generation lengths
and metrics are its ``constants.py`` and ``evaluate.py``. Three things differ, because no hub is reached at run time:
the essay haystack is Shakespeare (h2o-kv's offline corpus) instead of Paul Graham's essays, and the two QA tasks are
synthetic question-answering built from that corpus instead of SQuAD and HotpotQA (`ruler_qa.py`); `SUBSTITUTES`
names each change so the tables can say it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALL = "string_match_all"  # fraction of the gold answers found in the output (RULER's niah, vt, cwe, fwe)
PART = "string_match_part"  # 1 if any gold answer is found (RULER's qa)
METRICS = (ALL, PART)


@dataclass(frozen=True)
class Spec:
    family: str  # niah, vt, cwe, fwe or qa: the generator (ruler_niah, ruler_words, ruler_qa)
    tokens: int  # RULER's tokens_to_generate; the prompt plus these fit the length (RULER's max_seq_length)
    metric: str
    options: dict[str, Any] = field(default_factory=dict)


def _niah(haystack: str, key: str, value: str, keys: int = 1, values: int = 1, queries: int = 1) -> Spec:
    return Spec("niah", 128, ALL, dict(haystack=haystack, key=key, value=value, keys=keys, values=values,
                                       queries=queries))  # fmt: skip


SPECS: dict[str, Spec] = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", values=4),
    "niah_multiquery": _niah("essay", "words", "numbers", keys=4, queries=4),
    "vt": Spec("vt", 30, ALL, dict(chains=1, hops=4)),
    "cwe": Spec("cwe", 120, ALL, dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": Spec("fwe", 50, ALL, dict(alpha=2.0, word_len=6)),
    "qa_1": Spec("qa", 32, PART, dict(hops=1)),
    "qa_2": Spec("qa", 32, PART, dict(hops=2)),
}
RULER_TASKS: tuple[str, ...] = tuple(SPECS)
# The tasks whose context can hold several independent questions (`ruler_tasks`' questions=): the multikey needles (one
# question per needle's key) and the QA documents (one gold document, or pair, per question). The others keep their one
# question: niah_multivalue's context has a single key (asking it again in other words adds no independent question),
# niah_single_* would become multikey, niah_multiquery already asks its four keys at once, and vt / cwe / fwe have one
# answer set per context.
SEVERAL_QUESTIONS: tuple[str, ...] = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "qa_1", "qa_2")

_ESSAY = "essay haystack: Shakespeare, not Paul Graham's essays"
SUBSTITUTES: dict[str, str] = {
    **{t: _ESSAY for t, s in SPECS.items() if s.options.get("haystack") == "essay"},
    "qa_1": "synthetic single-fact QA over Shakespeare passages, not SQuAD",
    "qa_2": "synthetic two-fact (bridge) QA over Shakespeare passages, not HotpotQA",
}


def label(task: str) -> str:
    """The task's name as tables print it: the QA substitutes are marked, so no one reads them as SQuAD/HotpotQA."""
    return f"{task} (synthetic)" if SPECS.get(task) is not None and SPECS[task].family == "qa" else task

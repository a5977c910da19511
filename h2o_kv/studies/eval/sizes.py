"""What `h2o-kv eval` runs by default and how big: tasks, policies, budgets and the size presets.

"small" runs in minutes on a laptop CPU (the committed results); "large" is the fuller protocol; a preset may name
its own tasks, policies and budgets ("compress-once"), which the CLI takes where its flags are not given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from h2o_kv.policies import policy_key
from h2o_kv.studies.eval.ruler_spec import RULER_TASKS

INT8 = "-int8"  # a policy name with this suffix stores its kept keys and values as int8 (KVCache(kv_dtype="int8"))

TASKS = ("perplexity", "retrieval", "fidelity", "summarize")
DEFAULT_TASKS = ("perplexity", "retrieval", "fidelity")
DEFAULT_POLICIES = ("h2o", "local", "streamingllm", "tova")
DEFAULT_BUDGETS = (0.05, 0.1, 0.2, 0.5)
COMPRESS_ONCE_TASKS = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "qa_1", "qa_2")


@dataclass(frozen=True)
class PerplexitySize:
    windows: int  # text windows, one per text of the corpus where possible
    length: int  # tokens per window (budgets are resolved against it)
    chunk: int | None  # tokens fed between evictions (1: token by token)


@dataclass(frozen=True)
class RetrievalSize:
    tasks: tuple[str, ...]  # RULER-style tasks (see ruler.TASKS)
    contexts: tuple[int, ...]  # context lengths in tokens
    samples: int  # samples per task and context (needle depths sweep evenly)
    prefills: tuple[str, ...]  # "oneshot" (query-aware), "agnostic" (query-agnostic) and/or "stream" (retrieval.py)
    chunk: int  # tokens per call when streaming the prompt
    answer_cap: int | None  # at most this many answer tokens (None: RULER's lengths)
    questions: int = 1  # questions per context for RULER's multikey and QA tasks (ruler_tasks; 1: one, as always)


@dataclass(frozen=True)
class FidelitySize:
    prompts: int  # questions about passages of the corpus
    passage_tokens: int
    new_tokens: int  # greedy tokens compared with Full's


@dataclass(frozen=True)
class SummarizeSize:
    records: int  # first records of the JSONL file
    new_tokens: int
    document_tokens: int  # documents are cut to this many tokens


@dataclass(frozen=True)
class Size:
    perplexity: PerplexitySize
    retrieval: RetrievalSize
    fidelity: FidelitySize
    summarize: SummarizeSize
    # what `h2o-kv eval --size NAME` runs where --tasks, --policies or --budgets are not given (None: the defaults)
    eval_tasks: tuple[str, ...] | None = None
    policies: tuple[str, ...] | None = None
    budgets: tuple[float | int, ...] | None = None

    def with_chunk(self, chunk: int | None) -> Size:
        """The same size with `chunk` tokens between evictions when streaming (perplexity and retrieval)."""
        if chunk is None:
            return self
        return replace(
            self, perplexity=replace(self.perplexity, chunk=chunk), retrieval=replace(self.retrieval, chunk=chunk)
        )

    def with_contexts(
        self,
        contexts: tuple[int, ...] | None,
        prefills: tuple[str, ...] | None = None,
        tasks: tuple[str, ...] | None = None,
        samples: int | None = None,
        questions: int | None = None,
    ) -> Size:
        """The same size with other retrieval context lengths, prefill settings, tasks, samples per task or questions
        per context."""
        retrieval = self.retrieval
        if questions is not None:
            retrieval = replace(retrieval, questions=questions)
        if tasks is not None:
            retrieval = replace(retrieval, tasks=tasks)
        if samples is not None:
            retrieval = replace(retrieval, samples=samples)
        if contexts is not None:
            retrieval = replace(retrieval, contexts=contexts)
        if prefills is not None:
            retrieval = replace(retrieval, prefills=prefills)
        return replace(self, retrieval=retrieval)

    def with_windows(self, windows: int | None) -> Size:
        """The same size with another number of perplexity windows."""
        if windows is None:
            return self
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            raise ValueError(f"--windows must be a count of text windows >= 1, got {windows!r}")
        return replace(self, perplexity=replace(self.perplexity, windows=windows))

    def settings(self) -> dict[str, Any]:
        """The size as plain data, for the results' metadata."""
        return asdict(self)


SIZES: dict[str, Size] = {
    # A first run that shows the tables and plots, in under a minute on 2 CPU cores: too few samples to rank policies
    "tiny": Size(
        PerplexitySize(windows=1, length=192, chunk=64),
        RetrievalSize(("passkey",), (192,), samples=1, prefills=("oneshot",), chunk=16, answer_cap=8),
        FidelitySize(prompts=1, passage_tokens=96, new_tokens=8),
        SummarizeSize(records=2, new_tokens=16, document_tokens=256),
    ),
    "small": Size(
        PerplexitySize(windows=4, length=1024, chunk=1),
        RetrievalSize(("passkey", "niah_single"), (512, 1024), samples=2, prefills=("oneshot", "stream"),
                      chunk=16, answer_cap=16),
        FidelitySize(prompts=6, passage_tokens=320, new_tokens=64),
        SummarizeSize(records=8, new_tokens=64, document_tokens=768),
    ),
    "large": Size(
        PerplexitySize(windows=8, length=4096, chunk=1),
        RetrievalSize(("passkey", "niah_single", "niah_multikey", "variable_tracking", "common_words"),
                      (1024, 2048, 4096), samples=10, prefills=("oneshot", "stream"), chunk=16, answer_cap=None),
        FidelitySize(prompts=16, passage_tokens=1024, new_tokens=128),
        SummarizeSize(records=100, new_tokens=64, document_tokens=2048),
    ),
    # Needle retrieval with enough samples to separate policies (issue 8's side-by-side with kvpress):
    # 20 samples per context with needle depths spread over (0, 1), whole-prompt and streamed prefill.
    "niah": Size(
        PerplexitySize(windows=4, length=1024, chunk=1),
        RetrievalSize(("niah_single",), (1024, 2048), samples=20, prefills=("oneshot",), chunk=16, answer_cap=16),
        FidelitySize(prompts=6, passage_tokens=320, new_tokens=64),
        SummarizeSize(records=8, new_tokens=64, document_tokens=768),
    ),
    # The other retrieval cells of the kvpress side by side: the same samples as compare/kvpress
    # (20 per context, passkey depths spread over (0, 1)) and its cap of 32 answer tokens.
    "ruler": Size(
        PerplexitySize(windows=4, length=1024, chunk=1),
        RetrievalSize(("passkey", "variable_tracking"), (1024, 2048), samples=20, prefills=("oneshot",), chunk=16,
                      answer_cap=32),
        FidelitySize(prompts=6, passage_tokens=320, new_tokens=64),
        SummarizeSize(records=8, new_tokens=64, document_tokens=768),
    ),
    # Issue 40's study on a real model (Qwen2.5-Coder-0.5B): needle, passkey and variable tracking at 4k and 2k
    # tokens, 20 samples each, whole-prompt prefill (one shared prefill per sample); streaming perplexity over
    # 2k-token windows fed 16 tokens between evictions.
    "qwen": Size(
        PerplexitySize(windows=4, length=2048, chunk=16),
        RetrievalSize(("niah_single", "passkey", "variable_tracking"), (4096, 2048), samples=20, prefills=("oneshot",),
                      chunk=16, answer_cap=32),
        FidelitySize(prompts=6, passage_tokens=1024, new_tokens=64),
        SummarizeSize(records=8, new_tokens=64, document_tokens=2048),
    ),
    # Issue 52: RULER's thirteen tasks at 4k (kvpress's leaderboard set; ruler_spec.py), RULER's answer lengths, both
    # settings from one shared prefill each: query-aware (question in the compressed prompt) and query-agnostic
    # (the context compressed alone, the question after). 5 samples per task; more samples reuse the first ones' cells.
    "ruler4k": Size(
        PerplexitySize(windows=4, length=2048, chunk=16),
        RetrievalSize(RULER_TASKS, (4096,), samples=5, prefills=("oneshot", "agnostic"), chunk=16, answer_cap=None),
        FidelitySize(prompts=6, passage_tokens=1024, new_tokens=64),
        SummarizeSize(records=8, new_tokens=64, document_tokens=2048),
    ),
    # Issue 50: compress once, answer many. Query-agnostic at 4k: each context compressed once without its questions,
    # then 4 questions answered from forks of that cache (RULER's multikey needles, one key each; the QA documents, one
    # gold document or pair each; niah_multivalue has one key, so one question). kvpress runs the same ids with its
    # pipeline's questions=[...] (compare/kvpress). 5 samples per task; retrieval only, its own policies and budgets
    # (the query-agnostic ones, and the query-aware ones kvpress also has, with `serve`'s GlobalKV).
    "compress-once": Size(
        PerplexitySize(windows=4, length=2048, chunk=16),
        RetrievalSize(COMPRESS_ONCE_TASKS, (4096,), samples=5, prefills=("agnostic",), chunk=16, answer_cap=None,
                      questions=4),
        FidelitySize(prompts=6, passage_tokens=1024, new_tokens=64),
        SummarizeSize(records=8, new_tokens=64, document_tokens=2048),
        eval_tasks=("retrieval",),
        policies=("kvzipwindow", "kvziplayerwindow", "kvzipwhole", "kvzip", "keydiff", "snapkv", "globalkv", "tova",
                  "h2o"),
        budgets=(0.25, 0.1),
    ),
}  # fmt: skip


def check_eval(tasks: Sequence[str], policies: Sequence[str], data: str | None) -> None:
    """Refuse, before any model call, tasks and policy names that do not exist, and summarize without data."""
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; choose from {', '.join(TASKS)}")
    if "summarize" in tasks and not data:
        raise ValueError("the summarize task needs a JSONL file (data=..., CLI --data) with document and summary")
    for name in policies:
        policy_key(name.removesuffix(INT8))  # as decoding.new_cache reads it


def check_retrieval(retrieval: RetrievalSize) -> None:
    """Refuse, before any model call, prefill settings that do not exist and query-agnostic runs of tasks that have no
    question part (only RULER's thirteen split their prompt into context and question)."""
    if isinstance(retrieval.questions, bool) or not isinstance(retrieval.questions, int) or retrieval.questions < 1:
        raise ValueError(f"--questions must be a count of questions per context >= 1, got {retrieval.questions!r}")
    unknown = set(retrieval.prefills) - {"oneshot", "agnostic", "stream"}
    if unknown:
        raise ValueError(f"unknown prefill setting(s) {sorted(unknown)}; choose from oneshot, agnostic, stream")
    older = [t for t in retrieval.tasks if t not in RULER_TASKS]
    if "agnostic" in retrieval.prefills and older:
        raise ValueError(f"query-agnostic needs RULER's thirteen tasks; {', '.join(older)} have no question part")

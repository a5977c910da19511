"""`run_eval`: run a model under policies x budgets on the accuracy tasks; write tables and plots.

Every task reduces to rows of (policy, budget) -> metrics, with Full run once as the reference.
Rows are written long-form (tables.py) so a single table holds every task: `results.json` (with the
run's settings and timings), `results.csv`, `summary.md` and one PNG per task (plots.py). Perplexity and
retrieval, the long tasks, run cell by cell (cells.py): each finished cell is stored under `<out>/cells/`,
and `resume=True` reuses the stored ones, so an interrupted study picks up where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.studies.eval.cells import Cells, source_digest
from h2o_kv.studies.eval.retrieval import SHARED_PREFILLS
from h2o_kv.studies.eval.sizes import (
    DEFAULT_BUDGETS,
    DEFAULT_POLICIES,
    DEFAULT_TASKS,
    SIZES,
    Size,
    check_eval,
    check_retrieval,
)
from h2o_kv.studies.eval.tables import COLUMNS, long_rows, summary_markdown
from h2o_kv.studies.report import environment, write_csv, write_json

Config = tuple[str, Budget]


def configs(policies: Sequence[str], budgets: Sequence[Budget]) -> list[Config]:
    """Full first (the reference), then every (policy, budget)."""
    return [("full", None)] + [(p, b) for p in policies if p.lower() != "full" for b in budgets]


def run_eval(
    model: Any,
    tokenizer: Any,
    *,
    tasks: Sequence[str] = DEFAULT_TASKS,
    policies: Sequence[str] = DEFAULT_POLICIES,
    budgets: Sequence[Budget] = DEFAULT_BUDGETS,
    size: str | Size = "small",
    mode: Mode = "drop",
    corpus: str | None = None,
    data: str | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    chunk: int | None = None,
    command: str | None = None,
    resume: bool = False,
) -> list[dict]:
    """Evaluate `model` under each policy at each budget (fractions or token counts) on `tasks`.

    tasks: "perplexity" (streaming, on `corpus`), "retrieval" (RULER-style, `corpus` as haystack),
    "fidelity" (greedy drift from Full), "summarize" (needs `data`, an XSUM-style JSONL file).
    `size` is a preset name ("small", "large") or a `sizes.Size`; `chunk` overrides its tokens
    between evictions when streaming. Returns the long-form rows; with `out_dir`, also writes the
    tables and plots there, and every finished perplexity and retrieval cell under `out_dir/cells/`;
    `resume` reuses the cells stored there whose model, settings and h2o-kv source match (cells.py).
    """
    import torch
    import transformers
    from tqdm.auto import tqdm

    sized = (SIZES[size] if isinstance(size, str) else size).with_chunk(chunk)
    check_eval(tasks, policies, data)
    if "retrieval" in tasks:
        check_retrieval(sized.retrieval)
    runs = configs(policies, budgets)
    model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    if out_dir is None:  # nothing is stored, so nothing needs a key
        cells = Cells(None, {})
    else:
        identity = dict(model=model_name, dtype=str(model.dtype), mode=mode, seed=seed, corpus=corpus,
                        code=source_digest(), torch=torch.__version__,
                        transformers=transformers.__version__)  # fmt: skip
        cells = Cells(Path(out_dir) / "cells", identity, resume=resume)
    retrieval = sized.retrieval
    shared_passes = max(1, sum(p in SHARED_PREFILLS for p in retrieval.prefills))  # Full runs shared even if streamed
    units = {
        "perplexity": len(runs),
        "retrieval": len(retrieval.contexts)
        * (
            retrieval.samples * len(retrieval.tasks) * shared_passes
            + (len(runs) - 1) * ("stream" in retrieval.prefills)
        ),
        "fidelity": len(runs),
        "summarize": len(runs),
    }
    bar = tqdm(total=sum(units[t] for t in tasks), disable=not progress, desc="eval", unit="run")
    rows: list[dict] = []
    timings: dict[str, float] = {}
    for task in tasks:
        bar.set_description(task)
        start = time.perf_counter()
        run = dict(mode=mode, corpus=corpus, data=data, seed=seed, bar=bar, cells=cells)
        rows += TASK_RUNNERS[task](model, tokenizer, runs, sized, **run)
        timings[task] = round(time.perf_counter() - start, 1)
    bar.close()
    if out_dir is not None:
        meta = {
            "command": command,
            "size": size if isinstance(size, str) else "custom",
            "settings": sized.settings(),
            "tasks": list(tasks),
            "policies": list(policies),
            "budgets": list(budgets),
            "mode": mode,
            "corpus": corpus or "shakespeare (bundled, offline)",
            "data": data,
            "seed": seed,
            "seconds": timings,
            "cells": {"ran": cells.ran, "reused": cells.reused},
            "model": model_name,
            "environment": environment(),
        }
        write_results(rows, Path(out_dir), meta)
    return rows


def _perplexity(model, tokenizer, runs: list[Config], size: Size, *, mode, corpus, data, seed, bar, cells) -> list:
    from h2o_kv.studies.eval.perplexity import run_perplexity, text_windows

    ppl = size.perplexity
    windows = text_windows(tokenizer, corpus, n=ppl.windows, length=ppl.length, seed=seed)
    setting = dict(task="perplexity", windows=ppl.windows, length=ppl.length, chunk=ppl.chunk)
    wide = []
    for run in runs:
        compute = partial(run_perplexity, model, windows, [run], mode=mode, chunk=ppl.chunk, progress=bar)
        wide += cells.get(dict(setting, policy=run[0], budget=run[1]), compute, bar)
    for r in wide:
        r["n"] = len(windows)
    return long_rows("perplexity", wide, prefill="stream", mode=mode, chunk=ppl.chunk)


def _retrieval(model, tokenizer, runs: list[Config], size: Size, *, mode, corpus, data, seed, bar, cells) -> list:
    """Every context length: Full and the oneshot (query-aware) and agnostic (query-agnostic) policies from one
    shared prefill per sample and setting (Full's oneshot answers serve the streamed setting too), the streamed
    policies one batched cell each."""
    from h2o_kv.studies.data import load_corpus
    from h2o_kv.studies.eval.retrieval import make_samples, run_retrieval, run_shared

    ret = size.retrieval
    haystack = load_corpus(corpus, max_chars=2_000_000)
    rows = []
    for context in ret.contexts:
        samples = make_samples(tokenizer, haystack, tasks=ret.tasks, context_tokens=context, n=ret.samples, seed=seed,
                               questions=ret.questions)  # fmt: skip
        setting = dict(task="retrieval", tasks=list(ret.tasks), samples=ret.samples, answer_cap=ret.answer_cap,
                       context=context, **({"questions": ret.questions} if ret.questions > 1 else {}))  # fmt: skip
        shared = {}
        for prefill in [p for p in SHARED_PREFILLS if p in ret.prefills] or ["oneshot"]:
            configs = runs if prefill in ret.prefills else runs[:1]
            shared[prefill] = run_shared(model, tokenizer, samples, configs, cells=cells, mode=mode,
                                         gen_cap=ret.answer_cap, progress=bar,
                                         agnostic=prefill == "agnostic")  # fmt: skip
        full = [r for r in shared.get("oneshot", shared.get("agnostic", [])) if r["policy"] == "full"]
        for prefill in ret.prefills:
            if prefill in SHARED_PREFILLS:
                rows += long_rows("retrieval", shared[prefill], prefill=prefill, mode=mode, chunk=None)
                continue
            wide = list(full)
            for run in runs[1:]:
                compute = partial(run_retrieval, model, tokenizer, samples, [run], prefill=prefill, chunk=ret.chunk,
                                  mode=mode, gen_cap=ret.answer_cap, progress=bar)  # fmt: skip
                name = dict(setting, prefill=prefill, chunk=ret.chunk, policy=run[0], budget=run[1])
                wide += cells.get(name, compute, bar)
            rows += long_rows("retrieval", wide, prefill=prefill, mode=mode, chunk=ret.chunk)
    return rows


def _fidelity(model, tokenizer, runs: list[Config], size: Size, *, mode, corpus, data, seed, bar, cells) -> list:
    from h2o_kv.studies.eval.fidelity import passage_prompts, run_fidelity

    fid = size.fidelity
    prompts = passage_prompts(tokenizer, corpus, n=fid.prompts, passage_tokens=fid.passage_tokens, seed=seed)
    wide = run_fidelity(model, tokenizer, prompts, runs, max_new_tokens=fid.new_tokens, mode=mode, progress=bar)
    for r in wide:
        r["n"] = len(prompts)
    return long_rows("fidelity", wide, prefill="oneshot", mode=mode, chunk=None)


def _summarize(model, tokenizer, runs: list[Config], size: Size, *, mode, corpus, data, seed, bar, cells) -> list:
    from h2o_kv.studies.eval.summarize import load_jsonl, run_summarize

    summ = size.summarize
    records = load_jsonl(data, n=summ.records)
    wide = run_summarize(
        model, tokenizer, records, runs, max_new_tokens=summ.new_tokens, max_doc_tokens=summ.document_tokens,
        mode=mode, progress=bar,
    )  # fmt: skip
    return long_rows("summarize", wide, prefill="oneshot", mode=mode, chunk=None)


TASK_RUNNERS = {"perplexity": _perplexity, "retrieval": _retrieval, "fidelity": _fidelity, "summarize": _summarize}


def write_results(rows: list[dict], out: Path, meta: dict) -> None:
    """results.json (meta + rows), results.csv, summary.md and one PNG per task under `out`."""
    from h2o_kv.studies.eval.plots import plot_task  # matplotlib only when plots are written

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"meta": meta, "rows": rows})
    write_csv(out / "results.csv", COLUMNS, rows)
    (out / "summary.md").write_text(summary_markdown(rows, meta))
    for task in dict.fromkeys(r["task"] for r in rows):
        plot_task([r for r in rows if r["task"] == task], task, out / f"{task}.png")

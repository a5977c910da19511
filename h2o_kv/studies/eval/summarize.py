"""ROUGE summarisation (the paper's XSUM / CNN-DailyMail setting) on a user JSONL file.

Each line is {"document": ..., "summary": ...} (XSUM's field names). The model is asked for a
one-sentence summary of the document; its greedy summary is scored with ROUGE-L against the
reference summary, and against the Full cache's summary to show drift.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.runtime.generation import chat_text
from h2o_kv.studies.eval.decoding import greedy_generate
from h2o_kv.studies.eval.fidelity import encode
from h2o_kv.studies.eval.metrics import rouge_l

INSTRUCTION = "Summarise the following article in one sentence.\n\n{document}"


def load_jsonl(path: str | Path, *, n: int | None = None) -> list[dict[str, str]]:
    """The first `n` records of an XSUM-style JSONL file (fields `document` and `summary`)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or "document" not in rec or "summary" not in rec:
                raise ValueError(f"{path}:{lineno}: each line needs the fields 'document' and 'summary'")
            records.append({"document": str(rec["document"]), "summary": str(rec["summary"])})
            if n is not None and len(records) >= n:
                break
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def summary_prompts(
    tokenizer: Any, records: Sequence[dict[str, str]], *, max_doc_tokens: int | None = None
) -> list[str]:
    """Chat prompts asking for a one-sentence summary; documents cut to `max_doc_tokens` tokens."""
    prompts = []
    for rec in records:
        doc = rec["document"].strip()
        if max_doc_tokens is not None:
            ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
            if len(ids) > max_doc_tokens:
                doc = tokenizer.decode(ids[:max_doc_tokens])
        prompts.append(chat_text(tokenizer, INSTRUCTION.format(document=doc)))
    return prompts


def run_summarize(
    model: Any,
    tokenizer: Any,
    records: Sequence[dict[str, str]],
    configs: Sequence[tuple[str, Budget]],
    *,
    max_new_tokens: int = 64,
    max_doc_tokens: int | None = 1024,
    mode: Mode = "drop",
    progress: Any = None,
) -> list[dict]:
    """One row per (policy, budget): mean ROUGE-L against the references and against Full's summaries.

    The budget is a fraction of each batch's longest prompt (one-call prefill, as in the paper).
    """
    prompt_ids = encode(tokenizer, summary_prompts(tokenizer, records, max_doc_tokens=max_doc_tokens))
    length = max(len(p) for p in prompt_ids)
    refs = [r["summary"] for r in records]
    kw = dict(max_new_tokens=max_new_tokens, mode=mode, length=length)
    full_texts = [tokenizer.decode(o, skip_special_tokens=True) for o in
                  greedy_generate(model, tokenizer, prompt_ids, "full", None, **kw)]  # fmt: skip
    rows = []
    for policy, budget in configs:
        if policy == "full":
            texts = full_texts
        else:
            outs = greedy_generate(model, tokenizer, prompt_ids, policy, budget, **kw)
            texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        k = len(texts)
        rows.append(
            {
                "policy": policy,
                "budget": budget,
                "length": length,
                "rouge_l": sum(rouge_l(t, r) for t, r in zip(texts, refs, strict=True)) / k,
                "rouge_l_vs_full": sum(rouge_l(t, f) for t, f in zip(texts, full_texts, strict=True)) / k,
                "n": k,
            }
        )
        if progress is not None:
            progress.update(1)
    return rows

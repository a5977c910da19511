"""Export h2o-kv's retrieval samples to JSONL so kvpress (its own venv) runs on exactly the same inputs.

Run with the h2o-kv venv (it needs h2o_kv and transformers 5.23):

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python compare/kvpress/export_samples.py \
        --out compare/kvpress/samples.jsonl

One JSON object per line: the prompt text AND its token ids exactly as h2o-kv's retrieval runner
feeds them (``tokenizer(prompt)["input_ids"]``, no chat template: the "oneshot" setting reads these
ids in one call, question and answer prefix included), the gold answers with the RULER metric name
(the scorer copied as data), the generation length, the needle depth and h2o-kv's budget in tokens
at each fraction (``budget_tokens(f, context_tokens)``, per sequence and KV head).

Samples are the ones h2o-kv's study builds (`retrieval.make_samples`: task k of ``ruler.TASKS +
ruler.RULER_TASKS`` gets ``seed + 1000 * k``; the older needle tasks' depths are ``(i + 0.5) / n``).

RULER's thirteen tasks (``--tasks ruler`` or names such as ``niah_single_1,vt,qa_1``; issue 52) also carry their
split: ``context_ids`` and ``question_ids`` (the question and RULER's answer prefix), with ``input_ids`` exactly the
two joined, so run_kvpress.py's ``--setting query-agnostic`` compresses the context alone and feeds the question
after it, kvpress's own default, on the same ids as h2o-kv's ``--setting query-agnostic``. Their h2o-kv budgets are
fractions of what is compressed: ``h2o_kv_budget_tokens`` of the whole prompt (query-aware) and
``h2o_kv_budget_tokens_agnostic`` of the context; give them ``--gen-cap 0`` for RULER's answer lengths.

``--questions 4`` (issue 50, compress once, answer many): RULER's multikey and QA samples ask 4 questions over one
context (`h2o_kv.studies.eval.ruler_tasks`), and their records add ``questions``, a list of ``{"question",
"question_ids", "answers"}`` (the first is also the record's ``question_ids`` / ``answers``); the ids are the ones
``h2o-kv eval --questions 4 --setting query-agnostic`` feeds after the context. run_kvpress.py passes them as kvpress's
pipeline ``questions=[...]``. Other tasks (niah_multivalue: one key) keep their one question and no ``questions``.

``--check RESULTS.json`` instead re-scores the predictions cached by run_kvpress.py with h2o-kv's own
`h2o_kv.studies.eval.ruler.score` and fails if any score differs from the one run_kvpress.py recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from h2o_kv import load_model
from h2o_kv.policies import budget_tokens
from h2o_kv.runtime.bundled import BUNDLED_NAME
from h2o_kv.runtime.models import cache_dir
from h2o_kv.studies.data import load_corpus
from h2o_kv.studies.eval.retrieval import make_samples
from h2o_kv.studies.eval.ruler import RULER_TASKS, Sample, asked, max_new_tokens, score
from h2o_kv.studies.eval.ruler_fit import split_ids

SHORT = {"niah_single": "niah", "passkey": "passkey", "variable_tracking": "vt", **{t: t for t in RULER_TASKS}}


def samples_for(
    tokenizer, haystack: str, task: str, context: int, n: int, seed: int, questions: int = 1
) -> list[Sample]:
    """`n` samples of `task`, seeded as the retrieval runner seeds them (older needle tasks: depths (i + 0.5) / n)."""
    return make_samples(tokenizer, haystack, tasks=[task], context_tokens=context, n=n, seed=seed, questions=questions)


def sample_record(tokenizer, s: Sample, sid: str, budgets: list[float], cap: int | None) -> dict:
    """The sample's part of its JSONL record: text, token ids as h2o-kv's retrieval runner encodes them, golds, metric,
    generation length and h2o-kv's budgets in tokens; RULER's thirteen add their split and, with several questions,
    the ``questions`` list."""
    context_ids, question_ids = split_ids(tokenizer, s)  # as h2o_kv's retrieval runner encodes prompts
    ids = context_ids + question_ids
    new = max_new_tokens(s.task) if cap is None else min(max_new_tokens(s.task), cap)
    split = {}
    if question_ids:  # RULER's thirteen: budgets of what is compressed, per sample (as kvpress's)
        split = {
            "context_ids": context_ids,
            "question_ids": question_ids,
            "h2o_kv_budget_tokens_agnostic": {str(b): budget_tokens(b, len(context_ids)) for b in budgets},
        }
    if s.questions:  # several questions over the one context: each one's ids after the context's, and its golds
        split["questions"] = [{"question": a.question, "question_ids": split_ids(tokenizer, a)[1], "answers": a.answers}
                              for a in asked(s)]  # fmt: skip
    return {
        "id": sid,
        "task": s.task,
        "context_tokens": s.context_tokens,
        "depth": s.depth,
        "prompt": s.prompt,
        "input_ids": ids,
        "answers": s.answers,
        "metric": s.metric,  # ruler.score's metric for the task
        "max_new_tokens": new,
        "h2o_kv_budget_tokens": {str(b): budget_tokens(b, len(ids) if split else s.context_tokens) for b in budgets},
        **split,
        "seed": s.metadata["seed"],
    }


def kv_bytes_per_token(config) -> int:
    """Keys and values of one token over every layer, float32 (what kvpress's cache holds per kept token)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers * kv_heads * head * 2 * 4


def export(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(args.model, enable_h2o=False)
    model_dir = cache_dir() / "models" / args.model
    haystack = load_corpus(args.corpus, max_chars=2_000_000)
    budgets = [float(b) for b in args.budgets.split(",")]
    lines = []
    tasks = [t for name in args.tasks.split(",") for t in (RULER_TASKS if name == "ruler" else (name,))]
    for task in tasks:
        if task not in SHORT:
            raise ValueError(f"--tasks: {task!r} is not one of {sorted(SHORT)}")
        cap = None if args.gen_cap <= 0 else args.gen_cap
        for context in (int(c) for c in args.contexts.split(",")):
            for i, s in enumerate(samples_for(tokenizer, haystack, task, context, args.n, args.seed, args.questions)):
                record = sample_record(tokenizer, s, f"{SHORT[task]}-{context}-{i:02d}", budgets, cap) | {
                    "model_dir": str(model_dir),
                    "corpus": args.corpus or "shakespeare (h2o_kv.studies.data default)",
                    "eos_token_id": model.generation_config.eos_token_id,
                    "kv_bytes_per_token": kv_bytes_per_token(model.config),
                }
                lines.append(json.dumps(record))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} samples to {args.out} (model dir {model_dir})")


def check(results_path: str, samples_path: str) -> None:
    """Re-score run_kvpress.py's cached predictions with h2o-kv's own scorer; exit 1 on any mismatch."""
    samples, questions = {}, {}
    for line in Path(samples_path).read_text().splitlines():
        r = json.loads(line)
        samples[r["id"]] = Sample(r["prompt"], r["answers"], r["task"], r["context_tokens"], r["depth"],
                                  metric=r.get("metric", "string_match_all"))  # fmt: skip
        questions[r["id"]] = [q["answers"] for q in r.get("questions", [])]
    cells = json.loads(Path(results_path).read_text())["cells"]
    bad = total = 0
    for cell in cells.values():
        for sid, rec in cell["samples"].items():
            if "predictions" in rec:  # several questions: each prediction against its question's golds
                asks = zip(questions[sid], rec["predictions"], rec["scores"], strict=True)
                pairs = [(replace(samples[sid], answers=golds), pred, got) for golds, pred, got in asks]
            else:
                pairs = [(samples[sid], rec["prediction"], rec["score"])]
            for sample, prediction, recorded in pairs:
                total += 1
                if abs(score(sample, prediction) - recorded) > 1e-9:
                    bad += 1
                    print(f"mismatch {cell['press']} {cell['ratio']} {sid}: {recorded}", file=sys.stderr)
    print(f"re-scored {total} predictions with h2o_kv.studies.eval.ruler.score: {bad} mismatches")
    if bad:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="compare/kvpress/samples.jsonl")
    p.add_argument("--model", default=BUNDLED_NAME, help="a bundled model (kvpress loads its converted folder)")
    p.add_argument("--tasks", default="niah_single,passkey,variable_tracking", help="or 'ruler': RULER's thirteen")
    p.add_argument("--contexts", default="1024,2048")
    p.add_argument("--n", type=int, default=20, help="samples per (task, context length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=None, help="haystack source (default: h2o_kv.studies.data's default corpus)")
    p.add_argument("--gen-cap", type=int, default=32, help="cap on RULER's generation length (0: no cap)")
    p.add_argument("--budgets", default="0.1,0.2", help="h2o-kv budget fractions to record in tokens")
    p.add_argument("--questions", type=int, default=1,
                   help="questions per context of RULER's niah_multikey_* and qa_* (issue 50)")  # fmt: skip
    p.add_argument("--check", metavar="RESULTS_JSON", help="re-score run_kvpress.py's results instead")
    args = p.parse_args()
    if args.check:
        check(args.check, args.out)
    else:
        export(args)


if __name__ == "__main__":
    main()

"""kvpress 0.5.5 on h2o-kv's retrieval samples: whole prompt compressed in one call, then greedy answers.

Run with the kvpress venv (transformers < 5.3), after export_samples.py wrote the samples:

    OMP_NUM_THREADS=1 nice -n 19 compare/kvpress/.venv/bin/python compare/kvpress/run_kvpress.py \
        --samples compare/kvpress/samples.jsonl --out results/kvpress

Setting: h2o-kv's "oneshot" prefill. The prompt's token ids (exported by h2o-kv: context, question and
answer prefix) go through the model in ONE forward call with the press hooked in, so the press
compresses the whole prompt (the question's attention counts); the first answer token comes from
that call's logits; then greedy decoding (no press, as kvpress's pipeline decodes) for the sample's
``max_new_tokens``, stopping at EOS. kvpress's own pipeline would instead leave the question out of
the compression: that is ``--setting query-agnostic`` here (RULER's thirteen tasks, issue 52): the press
compresses the sample's ``context_ids`` alone, then the ``question_ids`` go through the compressed cache in
a second call without the press (positions after the context's, as kvpress's pipeline numbers them), and
the answer is decoded from that call's logits. Run each setting into its own ``--out``.

Several questions per context (issue 50: ``export_samples.py --questions 4``, ``--setting query-agnostic``): each
press compresses the context once and kvpress's pipeline answers every question from it, ``questions=[...]``, its
native mode (questions.py); each answer is scored by its question's golds, the sample's score is their mean. For the
study: ``--presses`` from press_registry.COMPRESS_ONCE_PRESSES (KVzip, ExpectedAttention, SnapKV, TOVA, KeyDiff, ...)
at ``--ratios 0.75,0.9`` (25 % and 10 % kept), as ``make -f compare/kvpress/Makefile kvpress-compress-once`` runs.

Presses (kvpress defaults otherwise): SnapKV, ExpectedAttention, TOVA, StreamingLLM, ObservedAttention
(kvpress's H2O-style press; needs eager attention, so it runs on an eager copy of the model) and
AdaKV(SnapKV), at compression ratios 0.8 and 0.9 (keep 20 % / 10 % of the prompt), plus Full
(the registry and an h2o-kv-style TOVA variant: press_registry.py).

One prefill serves every press (``--mode shared``, the default): a press compresses a layer's cache
after that layer's attention has run on the full prompt, so the prefill's hidden states and logits do
not depend on the press; each press's ``compress`` is called on the same (hidden states, keys,
values) and fills its own cache. ``--mode standard`` runs each press the documented way
(``with press(model): model(...)``), one prefill per press; ``--validate N`` runs both on N samples and
fails unless every prediction and every cache size agree.

KV bytes: the sum of the key and value tensors' bytes in the cache right after the prefill (float32).
AdaKV only masks evicted entries (kvpress simulates head-wise budgets), so its tensors keep every
token: its bytes are the Full cache's; ``kv_tokens_effective`` counts the unmasked tokens per head.

Results are cached per (press, ratio, task, context) cell in ``OUT/results.json`` after every sample, so
an interrupted run resumes where it stopped. Samples run round by round: each task's first sample (in
``--task-order``), then each one's next, needle depths spread early, so a partial run is balanced. Decoding stops
once every answer string is in the output (string match can only stay at 1.0 after that), otherwise at
EOS or ``max_new_tokens``. ``--summarize`` only rewrites the tables from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import kvpress
import torch
from kv_tools import answer_together, complete, kv_stats, score, set_masks, shared_prefill, standard_prefill, together
from press_registry import DEFAULT_PRESSES, EAGER, OWN_PASS, PRESSES, kvzip_masks
from questions import run_questions
from transformers import AutoModelForCausalLM


@torch.no_grad()
def decode(model, cache, first_logits: torch.Tensor, n_prompt: int, max_new: int, eos: set[int], done=None) -> list:
    """Greedy tokens from the prefill's last logits, positions continuing after the prompt (as kvpress).

    `done(tokens)` may stop early once the score cannot change any more (every answer already found).
    """
    out = [int(first_logits.argmax())]
    while len(out) < max_new and out[-1] not in eos and not (done and done(out)):
        pos = torch.tensor([[n_prompt + len(out) - 1]])
        logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, position_ids=pos).logits
        out.append(int(logits[0, -1].argmax()))
    return [t for t in out if t not in eos]


# ------------------------------------------------------------------------------------------- runs


def cell_key(
    press: str, ratio: float | None, task: str, context: int, agnostic: bool = False, questions: int = 1
) -> str:
    """The cell of (press, ratio, task, context) in one setting; several questions per sample: a cell of their own."""
    key = f"{press}|{ratio}|{task}|{context}" + ("|agnostic" if agnostic else "")
    return key + (f"|q{questions}" if questions > 1 else "")


def configs(names: list[str], ratios: list[float]) -> list[tuple[str, float | None]]:
    return [("full", None)] + [(n, r) for n in names for r in ratios]


def load_state(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"cells": {}}


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def run_sample(models: dict, rec: dict, todo: list, mode: str, eos: set[int], agnostic: bool = False,
               alone: bool = False) -> dict:  # fmt: skip
    """{(press, ratio): result} for one sample under every config in `todo`. `agnostic`: the press compresses the
    context alone; the question (its ids after the context's) is the next call, uncompressed, as kvpress's pipeline.
    A record with several questions runs kvpress's pipeline question by question (questions.py). Mode shared decodes
    the answers of the caches it can stack together (`kv_tools.together`), unless `alone`."""
    if agnostic and "questions" in rec:
        return run_questions(models, rec, todo, mode, alone)
    ids = torch.tensor([rec["context_ids"] if agnostic else rec["input_ids"]])
    n, new = ids.shape[1], rec["max_new_tokens"]
    question = torch.tensor([rec["question_ids"]]) if agnostic else None
    results = {}

    def record(cfg, tokens, stats, seconds, decode_s, **extra):
        text = models["tokenizer_decode"]([t for t in tokens if t not in eos])
        results[cfg] = {
            "prediction": text,
            "score": score(text, rec["answers"], rec["metric"]),
            "prompt_tokens": int(ids.shape[1] + (0 if question is None else question.shape[1])),
            **stats,
            "prefill_s": round(seconds, 3),
            "decode_s": round(decode_s, 3),
            **extra,
        }

    def finish(cfg, model, logits, cache, masks, seconds):
        stats = kv_stats(cache, masks)
        set_masks(model, masks)
        t0 = time.perf_counter()
        answered = complete(models["tokenizer_decode"], rec["answers"], rec["metric"])
        start = n
        if question is not None:  # positions after the context's, as kvpress's pipeline numbers the question
            start = n + question.shape[1]
            with torch.no_grad():
                logits = model(input_ids=question, past_key_values=cache, position_ids=torch.arange(n, start)[None],
                               logits_to_keep=1).logits[0, -1]  # fmt: skip
        tokens = decode(model, cache, logits, start, new, eos, answered)
        set_masks(model, None)
        record(cfg, tokens, stats, seconds, time.perf_counter() - t0)

    def finish_together(cfgs, model, logits, caches, seconds):
        set_masks(model, None)
        answered = complete(models["tokenizer_decode"], rec["answers"], rec["metric"])
        t0 = time.perf_counter()
        asked = None if question is None else [question]
        (outs,) = answer_together(model, [caches[c][0] for c in cfgs], n, asked, logits, new, eos, [answered])
        spent = (time.perf_counter() - t0) / len(cfgs)
        for cfg, tokens in zip(cfgs, outs, strict=True):  # decode_s: the batch's time over its rows
            record(cfg, tokens, kv_stats(caches[cfg][0], None), seconds, spent, decoded_with=len(cfgs))

    standard = todo if mode == "standard" else [c for c in todo if c[0] in OWN_PASS]  # KVzip: passes of its own
    passes = {}  # mode shared: KVzip's pass over this prompt by press (scores, first logits, cache), for other ratios
    for cfg in standard:
        name, ratio = cfg
        model = models["eager" if name in EAGER else "sdpa"]
        t0 = time.perf_counter()
        if name in passes:  # the same pass masked at this ratio (press_registry.kvzip_masks), the answer cut off
            scores, logits, cache = passes[name]
            cache.crop(n)
            masks = kvzip_masks(model, scores, ratio)
        else:
            press = None if name == "full" else PRESSES[name](ratio)
            logits, cache, masks = standard_prefill(model, ids, press)
            if mode == "shared" and hasattr(press, "scores"):
                passes[name] = (press.scores, logits, cache)
        finish(cfg, model, logits, cache, masks, time.perf_counter() - t0)
    for kind in ("sdpa", "eager"):
        group = [c for c in todo if c not in standard and (c[0] in EAGER) == (kind == "eager")]
        if not group:
            continue
        presses = {f"{name}|{ratio}": PRESSES[name](ratio) for name, ratio in group if name != "full"}
        t0 = time.perf_counter()
        logits, caches = shared_prefill(models[kind], ids, presses)
        seconds = time.perf_counter() - t0
        mine = {cfg: caches["full" if cfg[0] == "full" else f"{cfg[0]}|{cfg[1]}"] for cfg in group}
        for rows in [[cfg] for cfg in group] if alone else together(group, mine):
            if mine[rows[0]][1] is None and not alone:
                finish_together(rows, models[kind], logits, mine, seconds)
            else:
                finish(rows[0], models[kind], logits, *mine[rows[0]], seconds)
    return results


def load_models(model_dir: str, need_eager: bool) -> dict:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = AutoTokenizer.from_pretrained(model_dir)
    models = {"tokenizer": tok, "tokenizer_decode": lambda t: tok.decode(t, skip_special_tokens=True)}
    models["sdpa"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    models["sdpa"].eval()
    if need_eager:
        models["eager"] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        )
        models["eager"].eval()
    return models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", default="compare/kvpress/samples.jsonl")
    p.add_argument("--out", default="results/kvpress")
    p.add_argument("--presses", default=",".join(DEFAULT_PRESSES), help=f"any of {','.join(PRESSES)}")
    p.add_argument("--ratios", default="0.8,0.9", help="kvpress compression ratios (0.8 keeps 20 %%)")
    p.add_argument("--limit", type=int, default=0, help="first N samples per (task, context) only (0: all)")
    p.add_argument(
        "--task-order",
        default="niah_single,passkey,variable_tracking",
        help="the order of the tasks within each round of samples",
    )
    p.add_argument("--mode", choices=("shared", "standard"), default="shared",
                   help="shared: one prefill for every press; standard: each press its own (several questions: "
                   "kvpress's pipeline per press); KVzip: its pass once, each ratio masked")  # fmt: skip
    p.add_argument("--setting", choices=("query-aware", "query-agnostic"), default="query-aware",
                   help="query-agnostic: compress the context alone, then the question (RULER's 13); a sample "
                   "exported with several questions (export_samples.py --questions 4) is compressed once and each "
                   "question answered from it, kvpress's pipeline questions=[...] (issue 50)")  # fmt: skip
    p.add_argument("--decode", choices=("together", "alone"), default="together",
                   help="mode shared: the answers of the compressed caches without masks decoded in one batch a step, "
                   "the shorter ones padded (together), or each alone")  # fmt: skip
    p.add_argument("--validate", type=int, default=0, help="compare shared vs standard on N samples, then stop")
    p.add_argument("--summarize", action="store_true", help="only rewrite the tables from OUT/results.json")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "results.json"
    names = [s for s in args.presses.split(",") if s]
    unknown = set(names) - set(PRESSES)
    if unknown:
        raise ValueError(f"--presses: unknown {sorted(unknown)}; known: {sorted(PRESSES)}")
    ratios = [float(r) for r in args.ratios.split(",")]
    records = [json.loads(line) for line in Path(args.samples).read_text().splitlines() if line.strip()]
    if args.limit:
        seen: dict[tuple, int] = {}
        keep = []
        for r in records:
            key = (r["task"], r["context_tokens"])
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= args.limit:
                keep.append(r)
        records = keep
    # Interleave (task, context) groups and spread needle depths early (bit-reversed sample index), so a
    # partial run has every cell, with depths spread over (0, 1): each task's first sample, then each one's next.
    index: dict[tuple, int] = {}
    ranked = []
    for r in records:
        key = (r["task"], r["context_tokens"])
        index[key] = index.get(key, 0) + 1
        ranked.append((int(f"{index[key] - 1:08b}"[::-1], 2), r))
    order = {t: i for i, t in enumerate(args.task_order.split(","))}
    records = [r for _, r in sorted(ranked, key=lambda x: (x[0], order.get(x[1]["task"], len(order))))]
    from summary import write_summary

    if args.summarize:
        write_summary(load_state(state_path), records, out)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    eos_id = records[0]["eos_token_id"]
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id])
    agnostic = args.setting == "query-agnostic"
    if agnostic and not all("question_ids" in r for r in records):
        raise SystemExit("--setting query-agnostic needs samples with question_ids (export RULER's thirteen tasks)")
    if not agnostic and any("questions" in r for r in records):
        raise SystemExit("samples with several questions run --setting query-agnostic (compressed once, then each)")
    models = load_models(records[0]["model_dir"], need_eager=any(n in EAGER for n in names))
    cfgs = configs(names, ratios)
    if args.validate:
        validate(models, records[: args.validate], cfgs, eos, agnostic, alone=args.decode == "alone")
        return
    state = load_state(state_path)
    state["meta"] = {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "mode": args.mode,
        "decode": args.decode,
        "samples": args.samples,
        "model_dir": records[0]["model_dir"],
        "setting": args.setting,
        "questions": max(len(r.get("questions", [])) or 1 for r in records),
    }
    done = 0
    start = time.perf_counter()
    for i, rec in enumerate(records):
        asks = len(rec.get("questions", [])) or 1
        keys = {c: cell_key(c[0], c[1], rec["task"], rec["context_tokens"], agnostic, asks) for c in cfgs}
        todo = [c for c in cfgs if rec["id"] not in state["cells"].get(keys[c], {}).get("samples", {})]
        if not todo:
            continue
        began = time.perf_counter()
        results = run_sample(models, rec, todo, args.mode, eos, agnostic, alone=args.decode == "alone")
        seconds = state.setdefault("seconds", {})  # wall time per sample, summed over resumed runs (for summary.md)
        seconds[rec["id"]] = seconds.get(rec["id"], 0.0) + time.perf_counter() - began
        for cfg, res in results.items():
            cell = state["cells"].setdefault(
                keys[cfg],
                {"press": cfg[0], "ratio": cfg[1], "task": rec["task"], "context": rec["context_tokens"]}
                | ({"questions": asks} if asks > 1 else {})
                | {"samples": {}},
            )
            cell["samples"][rec["id"]] = res
        save_state(state_path, state)
        done += 1
        elapsed = time.perf_counter() - start
        print(f"[{i + 1}/{len(records)}] {rec['id']}: {len(todo)} configs, {elapsed / done:.1f} s/sample", flush=True)
    write_summary(state, records, out)


def agree(shared: dict, standard: dict) -> bool:
    """Whether mode shared's result is mode standard's: the same scores, each prediction the same or its start (an
    answer stopped once every gold was in it; a character cut in two at the stop set aside)."""
    mine = shared.get("predictions", [shared.get("prediction")])
    theirs = standard.get("predictions", [standard.get("prediction")])
    starts = all(b.startswith(a.rstrip("\ufffd")) for a, b in zip(mine, theirs, strict=True))
    return starts and shared.get("scores", shared["score"]) == standard.get("scores", standard["score"])


def validate(models: dict, records: list[dict], cfgs: list, eos: set[int], agnostic: bool = False,
             alone: bool = False) -> None:  # fmt: skip
    """Shared prefill vs one prefill per press (several questions: kvpress's pipeline, its own answers): the same
    scores, predictions (or their start: `agree`) and cache sizes, or exit 1."""
    bad = 0
    for rec in records:
        a = run_sample(models, rec, cfgs, "shared", eos, agnostic, alone)
        b = run_sample(models, rec, cfgs, "standard", eos, agnostic)
        for cfg in cfgs:
            said = {k: r[cfg].get("predictions", r[cfg].get("prediction")) for k, r in (("a", a), ("b", b))}
            same = agree(a[cfg], b[cfg]) and all(a[cfg][k] == b[cfg][k] for k in ("kv_bytes", "kv_tokens_effective"))
            bad += not same
            print(f"{rec['id']} {cfg}: shared {said['a']!r} standard {said['b']!r} "
                  f"bytes {a[cfg]['kv_bytes']}/{b[cfg]['kv_bytes']} {'ok' if same else 'DIFFERENT'}")  # fmt: skip
    print(f"validate: {bad} differences")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

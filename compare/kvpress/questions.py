"""Several questions over one compressed context, kvpress's native mode: its pipeline's ``questions=[...]`` (issue 50).

kvpress's `KVPressTextGenerationPipeline` compresses a context once with a press, then answers each question in turn:
the question at the positions after the whole (uncompressed) context, greedy decoding to EOS or ``max_new_tokens``,
and the question's and answer's tokens cut from the cache before the next (`generate_answer`,
`_remove_answer_from_cache`). Its `_forward` is given the exported ids (``context_ids`` and each question's
``question_ids``) rather than text, whose `preprocess` would tokenize again through the chat template: kvpress reads
the ids h2o-kv's ``--questions`` study feeds. ``--mode standard`` runs `_forward` for every press (the documented
way); ``--mode shared`` compresses once for every press (`kv_tools.shared_prefill`) and runs the pipeline's own
question loop on each press's cache; a press with passes of its own (KVzip) runs `_forward` at its first ratio, and
its other ratios mask the same cache from that pass's scores (`press_registry.kvzip_masks`: the pass does not
depend on the ratio). Each answer is
scored by its own question's golds; the KV bytes are those of the compressed context. In mode shared an answer stops
as soon as it holds every gold (`answer`: the pipeline's greedy loop, step for step, with that test), as h2o-kv's
answers and run_kvpress.py's one-question ones do: RULER's string match only grows with the text, so the score is
the pipeline's and the prediction its start (`--validate` checks both against mode standard, the pipeline's own).
"""

from __future__ import annotations

import time

import torch
from kv_tools import answer_together, attn_modules, complete, kv_stats, score, set_masks, shared_prefill, together
from kvpress import KVPressTextGenerationPipeline
from press_registry import EAGER, OWN_PASS, PRESSES, kvzip_masks
from transformers import DynamicCache


def pipelines(models: dict) -> dict:
    """One kvpress pipeline per loaded model ("sdpa", and "eager" where a press needs it)."""
    return {kind: KVPressTextGenerationPipeline(model=models[kind], tokenizer=models["tokenizer"])
            for kind in ("sdpa", "eager") if kind in models}  # fmt: skip


def stops_for(models: dict, rec: dict) -> list:
    """One stopping test per question of `rec` (`kv_tools.complete`)."""
    return [complete(models["tokenizer_decode"], q["answers"], rec["metric"]) for q in rec["questions"]]


@torch.no_grad()
def answer(pipe, question_ids: torch.Tensor, cache: DynamicCache, context_length: int, max_new_tokens: int,
           done) -> str:  # fmt: skip
    """The pipeline's `generate_answer`, step for step (the question at the positions after the whole context, its
    first token whatever it is, then greedy tokens until one is EOS or `max_new_tokens` are out), stopping sooner once
    `done(tokens)`: the prediction is then the start of the pipeline's, and its score the same."""
    model, device = pipe.model, pipe.model.device
    start = context_length + question_ids.shape[1]
    positions = torch.arange(context_length, start, device=device).unsqueeze(0)
    logits = model(input_ids=question_ids.to(device), past_key_values=cache, position_ids=positions,
                   logits_to_keep=1).logits  # fmt: skip
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokens = [int(logits[0, -1].argmax())]
    for i in range(max_new_tokens - 1):
        if done(tokens):
            break
        step = torch.tensor([[tokens[-1]]], device=device)
        logits = model(input_ids=step, past_key_values=cache, position_ids=torch.tensor([[start + i]], device=device))
        tokens.append(int(logits.logits[0, -1].argmax()))
        if tokens[-1] in eos:
            break
    return str(pipe.tokenizer.decode(tokens, skip_special_tokens=True))


@torch.no_grad()
def ask(pipe, cache: DynamicCache, context_length: int, questions: list[torch.Tensor], max_new: int,
        stops: list | None = None) -> list[str]:  # fmt: skip
    """The pipeline's question loop over a compressed cache, as its `_forward` runs it after the prefill (with
    `stops`, each answer by `answer`, which stops once its score is final)."""
    answers = []
    for i, question in enumerate(questions):
        lengths = [cache.get_seq_length(j) for j in range(len(cache))]
        if stops is None:
            answers.append(pipe.generate_answer(question_ids=question, cache=cache, context_length=context_length,
                                                max_new_tokens=max_new))  # fmt: skip
        else:
            answers.append(answer(pipe, question, cache, context_length, max_new, stops[i]))
        pipe._remove_answer_from_cache(cache, lengths)
    return answers


@torch.no_grad()
def ask_together(pipe, caches: list[DynamicCache], context_length: int, questions: list[torch.Tensor], max_new: int,
                 stops: list) -> list[list[str]]:  # fmt: skip
    """`ask` for several caches without masks at once (`kv_tools.together`): every question's answers are decoded in
    one batch, a row per (question, cache) over a stack of the context-only caches, as the pipeline's loop leaves
    each cache between questions (`kv_tools.answer_together`, stopping as `answer` does; a shorter cache's and a
    shorter question's pad slots masked out). Answers per cache, in question order."""
    model = pipe.model
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outs = answer_together(model, caches, context_length, questions, None, max_new, eos, stops)  # [question][cache]
    return [[str(pipe.tokenizer.decode(outs[j][i], skip_special_tokens=True)) for j in range(len(questions))]
            for i in range(len(caches))]  # fmt: skip


@torch.no_grad()
def native(pipe, press, context: torch.Tensor, questions: list[torch.Tensor], max_new: int,
           stops: list | None = None) -> tuple:  # fmt: skip
    """kvpress's pipeline on one context and its questions: (answers, the compressed cache, prefill s, answers s).
    With `stops`, its question loop answers by `answer` (the i-th call answers the i-th question)."""
    cache, spent, own = DynamicCache(), [0.0], pipe.generate_answer
    tests = iter(stops or ())

    def timed(**kwargs):
        begin = time.perf_counter()
        try:
            if stops is None:
                return own(**kwargs)
            return answer(pipe, kwargs["question_ids"], kwargs["cache"], kwargs["context_length"],
                          kwargs["max_new_tokens"], next(tests))  # fmt: skip
        finally:
            spent[0] += time.perf_counter() - begin

    pipe.generate_answer = timed
    begin = time.perf_counter()
    try:
        answers = pipe._forward({"context_ids": context, "questions_ids": questions}, max_new_tokens=max_new,
                                press=press, cache=cache)  # fmt: skip
    finally:
        del pipe.generate_answer  # the class's method again
    return answers, cache, time.perf_counter() - begin - spent[0], spent[0]


def masks_of(model) -> list | None:
    masks = [getattr(m, "masked_key_indices", None) for m in attn_modules(model)]
    return masks if any(m is not None for m in masks) else None


def run_questions(models: dict, rec: dict, todo: list, mode: str, alone: bool = False) -> dict:
    """{(press, ratio): result} for one record with several questions: each press compresses the context once, then
    every question is answered from that cache (the predictions, their scores and their mean). Mode shared answers
    the caches it can stack together in one batch (`ask_together`), unless `alone`."""
    pipes = models.setdefault("pipelines", pipelines(models))
    context = torch.tensor([rec["context_ids"]])
    asks = rec["questions"]
    questions = [torch.tensor([q["question_ids"]]) for q in asks]
    n, new = context.shape[1], rec["max_new_tokens"]
    stops = stops_for(models, rec) if mode == "shared" else None  # the documented way: the pipeline's own answers
    results = {}

    def finish(cfg, answers, stats, prefill_s, decode_s):
        scores = [score(a, q["answers"], rec["metric"]) for a, q in zip(answers, asks, strict=True)]
        results[cfg] = {"predictions": answers, "scores": scores, "score": sum(scores) / len(scores),
                        "questions": len(scores), "prompt_tokens": n + max(len(q["question_ids"]) for q in asks),
                        **stats, "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3)}  # fmt: skip

    shared = [c for c in todo if mode == "shared" and c[0] not in OWN_PASS]
    passes = {}  # KVzip's pass over this context, by press: (its scores, the cache), which its other ratios reuse
    for cfg in (c for c in todo if c not in shared):
        kind = "eager" if cfg[0] in EAGER else "sdpa"
        model = models[kind]
        set_masks(model, None)
        if cfg[0] in passes:  # masked from the pass already run (mode shared), then the pipeline's question loop
            scores, cache = passes[cfg[0]]
            begin = time.perf_counter()
            masks = kvzip_masks(model, scores, cfg[1])
            prefill_s, begin = time.perf_counter() - begin, time.perf_counter()
            answers = ask(pipes[kind], cache, n, questions, new, stops)
            finish(cfg, answers, kv_stats(cache, masks), prefill_s, time.perf_counter() - begin)
        else:
            press = None if cfg[0] == "full" else PRESSES[cfg[0]](cfg[1])
            answers, cache, prefill_s, decode_s = native(pipes[kind], press, context, questions, new, stops)
            finish(cfg, answers, kv_stats(cache, masks_of(model)), prefill_s, decode_s)
            if mode == "shared" and hasattr(press, "scores"):
                passes[cfg[0]] = (press.scores, cache)  # the loop left the cache holding the context alone
        set_masks(model, None)
    for kind in ("sdpa", "eager"):
        group = [c for c in shared if (c[0] in EAGER) == (kind == "eager")]
        if not group:
            continue
        begin = time.perf_counter()
        _, caches = shared_prefill(models[kind], context, {f"{p}|{r}": PRESSES[p](r) for p, r in group if p != "full"})
        prefill_s = time.perf_counter() - begin
        mine = {cfg: caches["full" if cfg[0] == "full" else f"{cfg[0]}|{cfg[1]}"] for cfg in group}
        for rows in [[cfg] for cfg in group] if alone else together(group, mine):
            cache, masks = mine[rows[0]]
            begin = time.perf_counter()
            if masks is None and not alone:
                stats = {cfg: kv_stats(mine[cfg][0], None) for cfg in rows}
                answered = ask_together(pipes[kind], [mine[cfg][0] for cfg in rows], n, questions, new, stops)
                spent = (time.perf_counter() - begin) / len(rows)
                for cfg, answers in zip(rows, answered, strict=True):
                    finish(cfg, answers, stats[cfg] | {"decoded_with": len(rows)}, prefill_s, spent)
                continue
            stats = kv_stats(cache, masks)
            set_masks(models[kind], masks)
            answers = ask(pipes[kind], cache, n, questions, new, stops)
            set_masks(models[kind], None)
            finish(rows[0], answers, stats, prefill_s, time.perf_counter() - begin)
    return results

"""Probe (issue 50, the server's default): KVzip's ranking mixed with the prompt's own last queries.

    OMP_NUM_THREADS=1 python compare/probe_kvzip_window.py inside --share 0.3   # the defaults study's 8 questions
    OMP_NUM_THREADS=1 python compare/probe_kvzip_window.py after --share 0.3 -- --model qwen2.5-coder-0.5b \
        --size compress-once --policies kvzipwhole --budgets 0.25,0.1 --retrieval-tasks niah_multikey_3 \
        --samples 5 --out /tmp/co-mix --threads 1     # the compress-once study's cells (an `h2o-kv eval` run)

KVzip drops a question asked inside its prompt (compare/probe_question_kept.py); GlobalKV keeps what the question
asks about but loses a question asked after compression. This tries one policy for both, by patching every KVzip in
the process (nothing in the library changes): its pass also takes the prompt's last `--window` queries of the held
call, and each layer's slots those queries give the most probability (a layer's top `--share` x its per-head capacity
x its KV heads, of its head-pooled row: in AdaKV's rows that is twice `--share` of the row on a model with two KV
heads) rank above every reconstruction score; the prompt's last `--tail` tokens are always kept. `--share 0` gives
the window queries' peak the same footing as the reconstruction queries' (the larger of the two); `--window 0`
scores nothing more (the tail kept alone). Prints, per
question, what `kvzipwhole` answers at 20 % and 10 % with the patch (`inside`), or runs `h2o-kv eval` with it
(`after`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from h2o_kv.cache import reconstruct
from h2o_kv.policies.kvzip import KVzip


def patch(last: int, tail: int, share: float) -> None:
    """Patch KVzip (priority: the prompt's last `tail` tokens kept) and its pass (its `last` queries score)."""
    recent = KVzip.protected_recent

    def priority(self, state):
        base = torch.where(state.pos >= state.next_pos - recent(self, state), float("inf"), state.score)
        pinned = (state.pos >= state.prompt_len - tail) & (state.pos < state.prompt_len)
        return torch.where(pinned, float("inf"), base)

    KVzip.priority = priority
    KVzip.protected_recent = lambda self, state: None  # not the decode kernels' form any more: eager ranking
    attention, leave = reconstruct.Reconstruction.attention, reconstruct.Reconstruction.__exit__

    def held_attention(self, layer, query, attention_mask, *, scaling, window, softcap):
        if last and not self.scoring_now:  # a held call (batch 1, in one call): keep its last queries
            start = int(layer.next_pos.view(-1)[0]) if layer.is_initialized and layer.seen else 0
            qpos = torch.arange(start, start + query.shape[2]).view(1, -1)
            options = dict(scaling=scaling, window=window, softcap=softcap)
            self.__dict__.setdefault("window_queries", {})[layer.layer_idx] = (
                query[:, :, -last:].float(),
                qpos[:, -last:],
                options,
            )
        return attention(self, layer, query, attention_mask, scaling=scaling, window=window, softcap=softcap)

    def exit_(self, kind, error, trace):
        for layer in self.layers if kind is None else []:
            if layer.is_initialized and layer.layer_idx in self.__dict__.get("window_queries", {}):
                q, qpos, options = self.window_queries[layer.layer_idx]
                peak = reconstruct._peak(layer, q, qpos, want_out=False, **options)[1][..., : layer.used]
                if share:
                    heads = layer.kv_heads if layer.head is not None else 1
                    k = min(peak.shape[-1], max(1, int(share * float(layer.capacity.view(-1)[0]) * heads)))
                    top = peak >= peak.topk(k, dim=-1).values[..., -1:]
                    layer.score[..., : layer.used] += top.float() * 2.0  # above any probability
                else:
                    layer.score[..., : layer.used] = torch.maximum(layer.score[..., : layer.used], peak)
        return leave(self, kind, error, trace)

    reconstruct.Reconstruction.attention = held_attention
    reconstruct.Reconstruction.__exit__ = exit_


def inside(model_name: str, budgets: list[float]) -> None:
    import h2o_kv
    from h2o_kv.cache.kvcache import KVCache
    from h2o_kv.runtime.generation import encode, eos_ids
    from h2o_kv.studies.defaults import correct, first_line, passage, prompt, questions
    from h2o_kv.studies.eval.shared import shared_greedy
    from h2o_kv.studies.report import commit

    model, tokenizer = h2o_kv.load_model(model_name)
    eos, text = eos_ids(model, tokenizer), passage()
    caches = {f"kvzipwhole@{b:g}": (lambda b=b: KVCache(h2o_kv.policies.build("kvzipwhole", b))) for b in budgets}
    right = dict.fromkeys(caches, 0)
    asked = questions(text)
    print(f"{model_name}, commit {commit()}, {torch.get_num_threads()} torch threads", flush=True)
    for question, accepted in asked:
        ids = encode(tokenizer, prompt(text, question))
        start = time.perf_counter()
        answers = shared_greedy(model, ids, caches, max_new_tokens=12, eos=eos, done=first_line(tokenizer),
                                tokenizer=tokenizer)  # fmt: skip
        cells = {}
        for key, (tokens, _) in answers.items():
            said = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            cells[key] = {"answer": said, "correct": correct(said, accepted)}
            right[key] += cells[key]["correct"]
        print(json.dumps({"question": question, "seconds": round(time.perf_counter() - start), "cells": cells}),
              flush=True)  # fmt: skip
    print(" ".join(f"{key}: {n}/{len(asked)}" for key, n in right.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["inside", "after"])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--tail", type=int, default=32)
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.1])
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after `--`: `h2o-kv eval`'s arguments (after)
    args, eval_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    patch(args.window, args.tail, args.share)
    if args.mode == "inside":
        inside(args.model, args.budgets)
        return
    from h2o_kv.cli import main as cli

    sys.exit(cli(["eval", *eval_args]))


if __name__ == "__main__":
    main()

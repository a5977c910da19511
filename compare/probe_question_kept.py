"""Why KVzip answers a question inside its prompt worse than GlobalKV: what each keeps of the prompt's end.

    OMP_NUM_THREADS=1 python compare/probe_question_kept.py --budget 0.1 0.2

One prompt of the defaults study (results/defaults: 1,550 words of Hamlet, then "Hamlet says he is mad only in which
direction? Answer in a few words." through the chat template), compressed by each policy as a served request is
(`compress_with_logits`: KVzip's pass over the whole prompt, GlobalKV's one call). Prints, per policy and budget, the
share of (layer, KV head) rows that still hold the question's tokens and the chat template's assistant turn after
it, and the greedy answer from that cache.
"""

from __future__ import annotations

import argparse

import torch

import h2o_kv
from h2o_kv.runtime.compress import compress_with_logits
from h2o_kv.runtime.generation import encode, eos_ids, greedy_continue
from h2o_kv.studies.defaults import QUESTIONS, passage, prompt
from h2o_kv.studies.report import commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--budget", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--policies", nargs="+", default=["kvzipwhole", "globalkv"])
    args = parser.parse_args()
    model, tokenizer = h2o_kv.load_model(args.model)
    question = QUESTIONS[2][0]
    ids = encode(tokenizer, prompt(passage(), question))
    text_tail = encode(tokenizer, prompt("", question))  # the question and the template's end, as tokenized alone
    tail = sum(1 for a, b in zip(reversed(ids), reversed(text_tail), strict=False) if a == b)  # its tokens at the end
    print(f"{args.model}, {len(ids)} prompt tokens, the last {tail} the question and the assistant turn; commit "
          f"{commit()}, {torch.get_num_threads()} torch threads")  # fmt: skip
    eos = eos_ids(model, tokenizer)
    for budget in args.budget:
        for name in args.policies:
            policy = h2o_kv.policies.build(name, budget)
            cache, logits = compress_with_logits(model, torch.tensor([ids]), policy, tokenizer=tokenizer)
            held = cache.kept_map().kept.float()[..., len(ids) - tail : len(ids)].mean((0, 1))  # [tail]: share of rows
            with torch.no_grad():
                answer = greedy_continue(model, cache, logits, len(ids), 12, eos, None)
            said = tokenizer.decode(answer, skip_special_tokens=True).strip()
            print(
                f"{name}@{budget:g}: the question's tokens held in {float(held.mean()):.0%} of rows on average "
                f"(least {float(held.min()):.0%}, most {float(held.max()):.0%}); answer {said!r}",
                flush=True,
            )


if __name__ == "__main__":
    main()

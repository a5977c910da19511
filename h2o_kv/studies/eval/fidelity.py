"""Generation fidelity: how far a policy's greedy output drifts from the Full cache's output.

For real prompts (questions about passages of the corpus), each policy's greedy continuation is
compared with Full's: the number of leading tokens that agree before the first divergence (after
it the two condition on different prefixes) and ROUGE-L between the two texts. Because one flipped
near-tie derails a small model's whole continuation, a teacher-forced score is added: Full's output
is fed through the policy's cache token by token, and `top1_vs_full` is the share of Full's tokens
that the bounded cache would also have picked greedily at that step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from h2o_kv.cache.kvcache import Mode
from h2o_kv.policies import Budget
from h2o_kv.runtime import generation
from h2o_kv.studies.data import load_texts
from h2o_kv.studies.eval.decoding import greedy_generate, pad_id, teacher_forced_top1
from h2o_kv.studies.eval.metrics import agreement_until_divergence, rouge_l

QUESTIONS = (
    "Summarise what happens in this passage in two or three sentences.",
    "Who is speaking in this passage, and what do they want?",
    "Explain this passage in plain modern English.",
    "What is the mood of this passage? Quote one line that shows it.",
)


def passage_prompts(tokenizer: Any, corpus: str | None, *, n: int, passage_tokens: int, seed: int = 0) -> list[str]:
    """`n` chat prompts, each a question about a ~`passage_tokens`-token passage from a different text."""
    texts = [t for t in load_texts(corpus) if len(t) > 8 * passage_tokens] or load_texts(corpus)
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        text = texts[(i * len(texts)) // n] if n <= len(texts) else texts[i % len(texts)]
        start = rng.randrange(len(text) // 10, max(len(text) // 10 + 1, len(text) - 8 * passage_tokens))
        para = text.find("\n\n", start)
        start = para + 2 if 0 <= para < start + 2000 else start
        ids = tokenizer(text[start : start + 8 * passage_tokens], add_special_tokens=False)["input_ids"]
        passage = tokenizer.decode(ids[:passage_tokens]).strip()
        prompts.append(generation.chat_text(tokenizer, f"{passage}\n\n{QUESTIONS[i % len(QUESTIONS)]}"))
    return prompts


def encode(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of prompts that already carry the chat template (the tokenizer's special tokens added)."""
    return [generation.encode(tokenizer, p, chat=False) for p in prompts]


def compare(tokenizer: Any, full: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, float]:
    """Mean agreement of `other` with `full`: leading tokens until divergence (count and fraction of
    Full's length), ROUGE-L between the decoded texts, and the share of identical outputs."""
    agree, frac, rouge, same = [], [], [], []
    for a, b in zip(full, other, strict=True):
        n = agreement_until_divergence(list(a), list(b))
        agree.append(n)
        frac.append(n / len(a) if a else float(not b))
        rouge.append(rouge_l(tokenizer.decode(b), tokenizer.decode(a)))
        same.append(float(list(a) == list(b)))
    k = max(1, len(full))
    return {
        "agree_tokens": sum(agree) / k,
        "agree_frac": sum(frac) / k,
        "rouge_l_vs_full": sum(rouge) / k,
        "identical": sum(same) / k,
    }


def run_fidelity(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    configs: Sequence[tuple[str, Budget]],
    *,
    max_new_tokens: int = 64,
    mode: Mode = "drop",
    prefill_chunk: int | None = None,
    progress: Any = None,
) -> list[dict]:
    """One row per (policy, budget) comparing its greedy outputs with Full's (Full's row: itself)."""
    prompt_ids = encode(tokenizer, prompts)
    length = max(len(p) for p in prompt_ids)
    kw = dict(max_new_tokens=max_new_tokens, mode=mode, prefill_chunk=prefill_chunk, length=length)
    full = greedy_generate(model, tokenizer, prompt_ids, "full", None, **kw)
    pad = pad_id(tokenizer)
    rows = []
    for policy, budget in configs:
        gen = full if policy == "full" else greedy_generate(model, tokenizer, prompt_ids, policy, budget, **kw)
        top1 = teacher_forced_top1(model, prompt_ids, full, policy, budget, length=length, mode=mode, pad=pad)
        row = {"policy": policy, "budget": budget, "length": length, **compare(tokenizer, full, gen)}
        rows.append({**row, "top1_vs_full": sum(top1) / len(top1)})
        if progress is not None:
            progress.update(1)
    return rows

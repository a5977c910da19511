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

import torch

from h2o_kv.cache import KVCache, Mode
from h2o_kv.data import load_texts

from . import Budget, make_policy
from .metrics import agreement_until_divergence, rouge_l

QUESTIONS = (
    "Summarise what happens in this passage in two or three sentences.",
    "Who is speaking in this passage, and what do they want?",
    "Explain this passage in plain modern English.",
    "What is the mood of this passage? Quote one line that shows it.",
)


def chat_prompt(tokenizer: Any, user: str) -> str:
    """The model's chat format when it has one (instruct models answer better), else plain text."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{user}\n\nAnswer:"


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
        prompts.append(chat_prompt(tokenizer, f"{passage}\n\n{QUESTIONS[i % len(QUESTIONS)]}"))
    return prompts


def encode(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Prompt token ids as the runner feeds them (the tokenizer's special tokens included)."""
    return [tokenizer(p)["input_ids"] for p in prompts]


@torch.no_grad()
def greedy_generate(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    policy: str,
    budget: Budget,
    *,
    max_new_tokens: int | Sequence[int],
    mode: Mode = "drop",
    prefill_chunk: int | None = None,
    batch_size: int = 16,
    length: int | None = None,
) -> list[list[int]]:
    """Greedy continuations (token ids, cut at EOS) of left-padded batches, a fresh cache per batch.

    The budget is sized from `length` (default: the longest prompt), so every prompt gets the same
    cache. `prefill_chunk=None` reads the prompt in one call and evicts after it (the paper's
    generation setting); an int streams the prompt through the bounded cache in chunks.
    """
    length = length or max(len(p) for p in prompt_ids)
    per_prompt = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    outputs: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        batch = [list(p) for p in prompt_ids[start : start + batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        cache = KVCache(make_policy(policy, budget, length), mode=mode, prefill_chunk=prefill_chunk)
        new = max(per_prompt[start : start + batch_size])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=new,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=pad,
            use_cache=True,
        )
        for k, row in enumerate(out[:, width:].tolist()):
            cut = next((j for j, t in enumerate(row) if t in eos_ids), len(row))
            outputs.append(row[: min(cut, per_prompt[start + k])])
    return outputs


@torch.no_grad()
def teacher_forced_top1(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    policy: str,
    budget: Budget,
    *,
    length: int,
    mode: Mode = "drop",
    pad: int = 0,
    batch_size: int = 16,
) -> list[float]:
    """Per prompt, the share of `targets` (Full's greedy tokens) that are the policy's top-1 given Full's prefix.

    The prompt is read in one call and evicted after it, as in `greedy_generate`; the targets then
    go through the cache one token at a time (prefill_chunk=1), exactly as decoding would feed them.
    """
    scores: list[float] = []
    for start in range(0, len(prompt_ids), batch_size):
        prompts = [list(p) for p in prompt_ids[start : start + batch_size]]
        tgts = [list(t) for t in targets[start : start + batch_size]]
        width, steps = max(len(p) for p in prompts), max(1, max(len(t) for t in tgts))
        ids = torch.tensor([[pad] * (width - len(p)) + p + t + [pad] * (steps - len(t)) for p, t in zip(prompts, tgts)])
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * (len(p) + len(t)) + [0] * (steps - len(t)) for p, t in zip(prompts, tgts)]
        )
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = KVCache(make_policy(policy, budget, length), mode=mode)
        first = model(
            ids[:, :width], attention_mask=mask[:, :width], position_ids=position[:, :width], past_key_values=cache
        ).logits[:, -1:]
        cache.prefill_chunk = 1  # from here on, evict after every token, as while decoding
        end = width + steps - 1
        rest = model(
            ids[:, width:end], attention_mask=mask[:, :end], position_ids=position[:, width:end], past_key_values=cache
        ).logits
        predicted = torch.cat([first, rest], dim=1).argmax(-1)
        for row, t in zip(predicted.tolist(), tgts):
            scores.append(sum(a == b for a, b in zip(row, t)) / len(t) if t else 1.0)
    return scores


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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = []
    for policy, budget in configs:
        gen = full if policy == "full" else greedy_generate(model, tokenizer, prompt_ids, policy, budget, **kw)
        top1 = teacher_forced_top1(model, prompt_ids, full, policy, budget, length=length, mode=mode, pad=pad)
        row = {"policy": policy, "budget": budget, "length": length, **compare(tokenizer, full, gen)}
        rows.append({**row, "top1_vs_full": sum(top1) / len(top1)})
        if progress is not None:
            progress.update(1)
    return rows

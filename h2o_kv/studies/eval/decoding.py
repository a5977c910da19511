"""Batched greedy decoding and teacher-forced top-1 under a policy, on `h2o_kv.runtime.generation`'s calls.

Prompts of different lengths run as left-padded batches with a fresh cache per batch. The budget is
resolved against the evaluated `length` (`budget_tokens(budget, length)`), so every prompt of a task
keeps the same number of tokens, whatever its own length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from h2o_kv.cache.kvcache import KVCache, Mode
from h2o_kv.policies import Budget, budget_tokens, build
from h2o_kv.runtime.engine import Engine
from h2o_kv.runtime.generation import decode_step, forward
from h2o_kv.studies.eval.sizes import INT8


def kv_dtype_of(policy: str) -> str | None:
    return "int8" if policy.endswith(INT8) else None


def new_cache(policy: str, budget: Budget, length: int, *, mode: Mode = "drop", chunk: int | None = None,
              headroom: int = 0) -> KVCache:  # fmt: skip
    """A fresh cache for `policy` at `budget` resolved against `length` tokens ("full": no budget;
    "h2o-int8": H2O with int8 storage); `headroom`: `KVCache`'s (tokens held past the budget after the prompt)."""
    built = build(policy.removesuffix(INT8), budget_tokens(budget, length))
    return KVCache(built, mode=mode, prefill_chunk=chunk, kv_dtype=kv_dtype_of(policy), headroom=headroom)


def left_pad(rows: Sequence[Sequence[int]], pad: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, width], attention mask [B, width]) with each row right-aligned after `pad` tokens."""
    width = width or max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


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
    """Greedy continuations (token ids, EOS removed) through the engine, `batch_size` sequences at a time.

    The budget is sized from `length` (default: the longest prompt), so every prompt gets the same
    cache. `prefill_chunk=None` reads the prompt in one call and evicts after it (the paper's
    generation setting); an int streams the prompt through the bounded cache in chunks.
    """
    length = length or max(len(p) for p in prompt_ids)
    limits = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    engine = Engine(
        model, tokenizer, max_batch=batch_size, prefill_chunk=prefill_chunk, mode=mode, kv_dtype=kv_dtype_of(policy)
    )
    chosen = build(policy.removesuffix(INT8), budget_tokens(budget, length))
    requests = [
        engine.submit(list(ids), max_tokens=limit, policy=chosen) if limit > 0 else None
        for ids, limit in zip(prompt_ids, limits, strict=True)
    ]
    engine.run()
    return [[] if r is None else [t for t in r.result().token_ids if t not in engine.eos] for r in requests]


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
    go through the cache one decode step at a time, exactly as decoding would feed them.
    """
    device = model.device
    scores: list[float] = []
    for start in range(0, len(prompt_ids), batch_size):
        prompts = prompt_ids[start : start + batch_size]
        tgts = [list(t) for t in targets[start : start + batch_size]]
        ids, mask = left_pad(prompts, pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        steps = max(1, max(len(t) for t in tgts))
        fed = torch.tensor([t + [pad] * (steps - len(t)) for t in tgts], device=device)  # rows past their end: ignored
        cache = new_cache(policy, budget, length, mode=mode)
        logits = forward(model, cache, ids.to(device), positions=positions.to(device), attention_mask=mask.to(device))
        position = positions[:, -1].to(device) + 1
        predicted = [logits.argmax(-1)]
        for j in range(steps - 1):
            predicted.append(decode_step(model, cache, fed[:, j], position + j).argmax(-1))
        table = torch.stack(predicted, dim=1).tolist()
        scores += [sum(a == b for a, b in zip(row, t)) / len(t) if t else 1.0 for row, t in zip(table, tgts)]
    return scores

"""The model calls every generation path shares: chat prompts, prefill, one decode step, sampling.

The engine (continuous batching), `h2o-kv generate`, the eval and the bench all go through these
few functions, so a prompt is encoded, prefilled and decoded the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from h2o_kv.cache.stacked import Stacked


def chat_text(tokenizer, user: str, *, chat: bool = True) -> str:
    """The text the model sees for a user message: the tokenizer's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    return user


def encode(tokenizer, text: str, *, chat: bool = True) -> list[int]:
    """Token ids of a prompt (with the chat template applied when `chat`). Refuses an empty prompt."""
    if not text.strip():
        raise ValueError("the prompt is empty")
    ids = tokenizer(chat_text(tokenizer, text, chat=chat), add_special_tokens=not chat)["input_ids"]
    if chat and not ids:
        raise ValueError("the prompt is empty")
    return list(ids)


def forward(
    model: torch.nn.Module,
    cache: Cache,
    input_ids: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    all_logits: bool = False,
) -> torch.Tensor:
    """One model call over new tokens [B, n] with `cache`: logits of the last token [B, V] (float32),
    or of every token [B, n, V] with `all_logits`.

    `positions` [B, n] gives each row its own absolute positions (rows of a continuous batch are at
    different points of their sequences); by default transformers counts them from the cache.
    """
    kwargs = {}
    if positions is not None:
        kwargs["position_ids"] = positions
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if all_logits else 1,
        **kwargs,
    )
    logits = out.logits if all_logits else out.logits[:, -1]
    return logits.float()


def prefill(model, cache: Cache, input_ids: torch.Tensor, *, chunk: int | None = None, start: int = 0) -> torch.Tensor:
    """Feed a prompt [B, n] (continuing at absolute position `start`), in calls of `chunk` tokens if given.

    Returns the last token's logits [B, V]. With a KVCache the cache's own `prefill_chunk` also works
    (eviction between chunks inside one call); `chunk` here makes separate calls, so other work can
    run between them.
    """
    n = input_ids.shape[1]
    step = chunk or n
    logits = None
    for begin in range(0, n, step):
        piece = input_ids[:, begin : begin + step]
        pos = torch.arange(start + begin, start + begin + piece.shape[1], device=input_ids.device)
        logits = forward(model, cache, piece, positions=pos.expand(input_ids.shape[0], -1))
    assert logits is not None, "prefill needs at least one token"
    return logits


def decode_step(model, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Feed one token per row (tokens [B]) at `positions` [B]: the next logits [B, V]."""
    pos = None if positions is None else positions.view(-1, 1)
    return forward(model, cache, tokens.view(-1, 1), positions=pos)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 is greedy; top_p keeps the smallest nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, value, low, high in (("temperature", self.temperature, 0.0, 100.0), ("top_p", self.top_p, 0.0, 1.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        if self.top_p == 0.0:
            raise ValueError("top_p must be > 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return gen


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """The next token of one row from its logits [V]."""
    if sampling.greedy:
        return int(logits.argmax())
    # in float64 with the max subtracted first: any temperature or top_p > 0 a request may give (1e-300 and 5e-324
    # are 0 in float32) then yields 0 and -inf, never 0 / 0 (NaN probabilities), and the most likely token stays
    logits = logits.double()
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p  # the first: 0, never >= top_p > 0
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_ids(
    model, cache: Cache, prompt_ids: list[int], max_new_tokens: int, eos: set[int] = frozenset()
) -> list[int]:
    """Greedy continuation of one prompt (batch 1), stopping at an `eos` token (kept) or the limit."""
    logits = prefill(model, cache, torch.tensor([prompt_ids], device=model.device))
    return greedy_continue(model, cache, logits, len(prompt_ids), max_new_tokens, eos)


def greedy_continue(
    model,
    cache: Cache,
    logits: torch.Tensor,
    position: int,
    max_new_tokens: int,
    eos: set[int] = frozenset(),
    done=None,
) -> list[int]:
    """Greedy tokens of one sequence (batch 1) from its next-token `logits` [1, V], the next token at absolute
    `position`: stops at an `eos` token (kept), at the limit, or once `done(tokens)` says the answer is complete."""
    device = model.device
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(logits[0].argmax())
        out.append(token)
        if token in eos or len(out) == max_new_tokens or (done is not None and done(out)):
            break
        logits = decode_step(
            model, cache, torch.tensor([token], device=device), torch.tensor([position], device=device)
        )
        position += 1
    return out


def greedy_together(
    model,
    caches: list,
    logits: list[torch.Tensor],
    positions: list[int],
    max_new_tokens: int | list[int],
    eos: set[int] = frozenset(),
    done: list | None = None,
) -> list[list[int]]:
    """`greedy_continue` for several one-sequence `KVCache`s at once: row r continues `caches[r]` from its next-token
    `logits[r]` ([V] or [1, V]), its next token at absolute `positions[r]`, and stops as `greedy_continue` does (at an
    `eos` token, kept; at its limit, `max_new_tokens` or its own entry of it; once its `done[r](tokens)`). Each step
    is one model call over the rows still going (`cache.stacked.Stacked`): the weights are read once for all of
    them, where row-by-row decoding reads them once per row."""
    limits = [max_new_tokens] * len(caches) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    stops = [None] * len(caches) if done is None else list(done)
    outs: list[list[int]] = [[] for _ in caches]
    going = [row for row in range(len(caches)) if limits[row] > 0]
    nexts = {row: int(logits[row].reshape(-1).argmax()) for row in going}
    while going:
        still = []
        for row in going:
            out = outs[row]
            out.append(nexts[row])
            if not (out[-1] in eos or len(out) == limits[row] or (stops[row] is not None and stops[row](out))):
                still.append(row)
        going = still
        if not going:
            break
        device = model.device
        tokens = torch.tensor([outs[row][-1] for row in going], device=device)
        where = torch.tensor([positions[row] + len(outs[row]) - 1 for row in going], device=device)
        step = decode_step(model, Stacked([caches[row] for row in going]), tokens, where)
        nexts = dict(zip(going, step.argmax(-1).tolist(), strict=True))
    return outs


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end a sequence: the model's generation config's and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids

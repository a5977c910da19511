"""One prompt under each policy asked: its prefill, its answer (a few greedy tokens), and what its cache kept.

Each policy reads the prompt itself, in one call as `h2o-kv generate` does (or in chunks with `prefill_chunk`), so the
map is the one that policy's generation runs on (KVzip's prompt goes through its reconstruction pass, repeated in
chunks of `prefill_chunk` tokens, 512 without one, as the engine runs it); after the answer's tokens the cache's
`kept_map` says which (layer, KV head) rows still hold each prompt position. The page (page.py) draws the
`Inspection` this returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from h2o_kv import policies
from h2o_kv.cache.kept import KeptMap


@dataclass(frozen=True)
class Run:
    """One policy's pass over the prompt: what its cache kept at the end and the answer it gave."""

    label: str  # as asked ("snapkv@0.2")
    policy: str  # the policy built (`describe()`)
    kept: KeptMap  # on the CPU, every position seen (the prompt's first)
    answer: str
    new_tokens: int
    kv_bytes: int  # allocated at the end
    seconds: float

    @property
    def full_bytes(self) -> int:
        """What the positions seen would hold in a Full cache: the kept bytes per kept slot, for every slot."""
        slots = int(self.kept.kept_per_row().sum())
        return self.kept.kept_bytes * self.kept.rows * self.kept.positions // max(slots, 1)


@dataclass(frozen=True)
class Inspection:
    model: str
    question: str | None
    tokens: list[str]  # each prompt token's text, in order (their concatenation is the text the model read)
    runs: list[Run]

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)


def parse_policies(specs: list[str], budget: policies.Budget) -> list[tuple[str, policies.Policy]]:
    """`--policy` values, `name` or `name@budget` (the budget as --budget takes it), built; a name without a budget
    takes `budget`. Refuses an unknown name, a bad budget and a repeated spec with one ValueError."""
    built = []
    for spec in specs:
        name, at, text = spec.partition("@")
        own = policies.parse_budget(text) if at else budget
        key = policies.policy_key(name)
        policy = policies.build(key, None if key == "full" else own)
        label = key if key == "full" else f"{key}@{own:g}"
        if label in (seen for seen, _ in built):
            raise ValueError(f"--policy {spec} is given twice")
        built.append((label, policy))
    return built


def prompt_text(text: str, question: str | None) -> str:
    """The user message: the text, then the question after a blank line (as the demo asks)."""
    return text if question is None else f"{text.rstrip()}\n\n{question.strip()}"


def token_texts(tokenizer, text: str, ids: list[int], *, chat: bool) -> list[str]:
    """Each token's piece of the text the model reads (the chat template's included): from its offset to the next
    token's, so the pieces join to the whole text; per-token decoding where the tokenizer gives no offsets."""
    from h2o_kv.runtime.generation import chat_text

    full = chat_text(tokenizer, text, chat=chat)
    try:
        enc = tokenizer(full, add_special_tokens=not chat, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        same = list(enc["input_ids"]) == list(ids)
    except (NotImplementedError, ValueError, KeyError, TypeError):
        same = False
    if not same:
        return tokenizer.batch_decode([[i] for i in ids])
    starts = [start for start, _ in offsets]
    ends = starts[1:] + [len(full)]
    pieces = [full[start : max(start, end)] for start, end in zip(starts, ends)]
    if starts and starts[0] > 0:  # a template's leading text no token's offset covers
        pieces[0] = full[: ends[0]]
    return pieces


def answered(text: str) -> bool:
    """Whether `text` holds a whole line of answer: ended by a line break, with text that does not end in ":"."""
    return any(line.strip() and not line.rstrip().endswith(":") for line in text.split("\n")[:-1])


def inspect(
    model,
    tokenizer,
    text: str,
    asked: list[tuple[str, policies.Policy]],
    *,
    model_name: str,
    question: str | None = None,
    decode: int = 0,
    chat: bool = True,
    prefill_chunk: int | None = None,
    mode: str = "drop",
    progress=None,
) -> Inspection:
    """Run the prompt (`text`, then `question`) under each of `asked`, generating up to `decode` greedy tokens (with a
    question, to the end of the answer's first line: `answered`); `progress(run)` is told of each run as it ends.
    Refuses a prompt that, with its `decode` tokens, passes the model's context (one ValueError)."""
    from h2o_kv.cache.kvcache import KVCache
    from h2o_kv.model_config import text_config
    from h2o_kv.runtime.compress import CHUNK, compress_with_logits
    from h2o_kv.runtime.generation import encode, eos_ids, forward, greedy_continue

    user = prompt_text(text, question)
    ids = encode(tokenizer, user, chat=chat)
    context = int(getattr(text_config(model.config), "max_position_embeddings", 0) or 1 << 30)
    if len(ids) + decode > context:
        raise ValueError(f"the prompt has {len(ids)} tokens (+ {decode} to decode), more than the model's context of "
                         f"{context} tokens: shorten it")  # fmt: skip
    eos = eos_ids(model, tokenizer)
    done = None
    if question is not None:  # the answer's first line of text, not a lead-in such as "The numbers are:"
        done = lambda tokens: answered(tokenizer.decode(tokens, skip_special_tokens=True))  # noqa: E731
    runs = []
    for label, policy in asked:
        start = time.perf_counter()
        cache = KVCache(policy, mode=mode, prefill_chunk=prefill_chunk)
        with torch.no_grad():
            if policy.reconstructs:  # KVzip: the prompt through its reconstruction pass (h2o_kv.compress)
                logits = compress_with_logits(model, torch.tensor([ids]), tokenizer=tokenizer, cache=cache,
                                              chunk=prefill_chunk or CHUNK)[1]  # fmt: skip
            else:
                logits = forward(model, cache, torch.tensor([ids], device=model.device))
            new = greedy_continue(model, cache, logits, len(ids), decode, eos, done) if decode else []
        answer = tokenizer.decode(new, skip_special_tokens=True).strip()
        run = Run(label, policy.describe(), cache.kept_map(0).cpu(), answer, len(new), cache.nbytes(),
                  time.perf_counter() - start)  # fmt: skip
        runs.append(run)
        if progress is not None:
            progress(run)
    return Inspection(model_name, question, token_texts(tokenizer, user, ids, chat=chat), runs)

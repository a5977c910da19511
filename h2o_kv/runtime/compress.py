"""`h2o_kv.compress(model, input_ids, policy)`: a context compressed once, before its question is known.

    cache = h2o_kv.compress(model, doc_ids, h2o_kv.KVzip(budget=0.2), tokenizer=tokenizer)
    for question_ids in questions:
        ids = torch.cat([doc_ids, question_ids], 1)
        model.generate(ids, past_key_values=cache.fork(), max_new_tokens=64)  # generate feeds the question only

Any policy's context is its one prompt call. KVzip's (`policy.reconstructs`) runs the reconstruction pass
(cache/reconstruct.py): the context is held whole, then the model is asked to repeat it, chunk by chunk, and each
context token is scored by the attention those queries pay it. The reconstruction prompt is text, so it needs the
model's tokenizer, and its chat template when it has one (the repeat is the assistant's turn): both stay here, in
the runtime, never in the cache or the policies. `compress_with_logits` also returns the context's last logits (the
next token's); the engine runs the same pass across its steps (reconstructing.py) with `reconstruction_inputs` and
`score_piece`, one call of the pass each.
"""

from __future__ import annotations

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.cache.reconstruct import Reconstruction
from h2o_kv.policies import Policy
from h2o_kv.runtime.generation import chat_text, forward

REPEAT = "\n\nRepeat the previous context exactly."  # KVzip's prompt for the first chunk
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with"  # ... and for each later one,
OVERLAP = 8  # followed by the last tokens of the chunk before
SPLIT = "\u2063h2o-kv\u2063"  # a marker no chat template writes: where the user's text ends
CHUNK = 512  # context tokens a reconstruction call repeats, by default


def compress(
    model,
    input_ids: torch.Tensor,
    policy: Policy | None = None,
    *,
    tokenizer=None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = CHUNK,
    cache: KVCache | None = None,
) -> KVCache:
    """A cache holding the context `input_ids` [B, L] (left-padded rows with `attention_mask`) compressed by
    `policy`, or into `cache` (an empty KVCache: its mode, kv_dtype, ...). For KVzip, `tokenizer` writes the
    reconstruction prompt and the context is repeated in chunks of `chunk` tokens, so the pass holds at most the
    context plus one chunk (and its prompt). The model must be `h2o_kv.enable`d. Positions follow the mask, as
    `generate` counts them, so a question appended to `input_ids` continues each row where its context ends."""
    return compress_with_logits(model, input_ids, policy, tokenizer=tokenizer, attention_mask=attention_mask,
                                chunk=chunk, cache=cache)[0]  # fmt: skip


def compress_with_logits(
    model,
    input_ids: torch.Tensor,
    policy: Policy | None = None,
    *,
    tokenizer=None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = CHUNK,
    cache: KVCache | None = None,
) -> tuple[KVCache, torch.Tensor]:
    """`compress`, and the context's last logits [B, V] (float32): the next token's, from the context's own call
    (for KVzip the held call, every token in the cache), as a prompt call gives them."""
    if cache is None:
        if policy is None:
            raise TypeError("compress needs a policy (such as h2o_kv.KVzip(budget=0.2)) or an empty KVCache")
        cache = KVCache(policy)
    elif policy is not None and policy != cache.policy:
        raise ValueError(f"compress got {policy.describe()} and a cache of {cache.policy.describe()}: give one")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    device = model.device
    ids = input_ids.to(device)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        if not cache.policy.reconstructs:
            logits = forward(model, cache, ids, positions=positions, attention_mask=mask)
            cache.end_prompt()  # a fraction is the context's: the question comes in a later call
            return cache, logits
        if tokenizer is None:
            raise ValueError(f"{cache.policy.describe()} asks the model to repeat the context: pass tokenizer=")
        pieces = reconstruction_inputs(tokenizer, ids, mask, chunk)
        with cache.reconstruction() as rec:
            logits = forward(model, cache, ids, positions=positions, attention_mask=mask)
            for piece, piece_mask in pieces:
                score_piece(model, cache, rec, piece, piece_mask, mask)
    cache.end_prompt()
    return cache, logits


def score_piece(model, cache: KVCache, rec: Reconstruction, piece: torch.Tensor, piece_mask: torch.Tensor,
                mask: torch.Tensor) -> None:  # fmt: skip
    """One scoring call of the pass `rec` over `cache`, whose context has `mask` [B, L]: the piece [B, n]
    (`reconstruction_inputs`) starts where each row's context ends, for it is not part of the sequence."""
    lengths = mask.long().sum(1, keepdim=True)
    with rec.scoring():
        at = (lengths + piece_mask.cumsum(1) - 1).clamp(min=0)
        forward(model, cache, piece, positions=at, attention_mask=torch.cat([mask, piece_mask], 1))


def piece_overhead(tokenizer) -> int:
    """The most tokens a reconstruction call adds to its chunk: the repeat prompt (a later chunk's with the
    `OVERLAP` tokens before it) and the assistant turn."""
    first, later, turn = (encode_plain(tokenizer, text) for text in (REPEAT, REPEAT_PART, assistant_turn(tokenizer)))
    return max(len(first), len(later) + OVERLAP) + len(turn)


def reconstruction_inputs(
    tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, chunk: int = CHUNK
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KVzip's reconstruction calls for a context [B, L]: (ids, mask) [B, n] each, every row's real tokens chunked
    from its own start: `REPEAT` (or `REPEAT_PART` and the previous chunk's last `OVERLAP` tokens), the chat
    template's assistant turn, then the chunk; rows left-padded to one width (a row with no chunk left is padding)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    rows = [row[keep.bool()].tolist() for row, keep in zip(input_ids.cpu(), mask.cpu())]  # once per context
    first, later, turn = (encode_plain(tokenizer, text) for text in (REPEAT, REPEAT_PART, assistant_turn(tokenizer)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pieces = []
    for start in range(0, max(map(len, rows)), chunk):
        inputs = [
            [] if start >= len(row) else (first if start == 0 else later + row[max(0, start - OVERLAP) : start])
            + turn + row[start : start + chunk]
            for row in rows
        ]  # fmt: skip
        width = max(map(len, inputs))
        ids = torch.full((len(rows), width), pad, dtype=input_ids.dtype)
        piece_mask = torch.zeros(len(rows), width, dtype=mask.dtype)
        for r, tokens in enumerate(inputs):  # left padding
            if tokens:
                ids[r, width - len(tokens) :] = torch.tensor(tokens, dtype=input_ids.dtype)
                piece_mask[r, width - len(tokens) :] = 1
        pieces.append((ids.to(input_ids.device), piece_mask.to(input_ids.device)))
    return pieces


def assistant_turn(tokenizer) -> str:
    """What the chat template writes between a user's message and the assistant's answer ("\\n" without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    text = chat_text(tokenizer, SPLIT)
    return text.rsplit(SPLIT, 1)[1] if SPLIT in text else "\n"


def encode_plain(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

"""Incremental detokenization (runtime/detokenize.py): after every token the text equals a whole decode, with the
bundled models' tokenizers (byte-level BPE, SentencePiece) on text with multi-byte characters and on random ids,
while each step decodes a bounded number of tokens."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf

from h2o_kv.runtime.detokenize import EVERY, OVERLAP, Detokenizer, decoder

TEXT = "Ophelia: «Il était une fois» — naïve café, 東京 and Zürich 🎭🎭; def f(x):\n    return x ** 2  # ok\n" * 6


def bundled(name: str):
    from h2o_kv.runtime.models import bundled_gguf_path

    try:
        bundled_gguf_path(name)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return _load(name)


@functools.cache
def _load(name: str):  # once per model: a GGUF tokenizer takes seconds to read
    from h2o_kv.runtime.models import _resolve

    return tf.AutoTokenizer.from_pretrained(_resolve(name))


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("ids_from", ["text", "random"])
def test_the_text_after_every_token_is_the_whole_decode(name, ids_from):
    tokenizer = bundled(name)
    if ids_from == "text":
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
    else:
        ids = torch.randint(0, len(tokenizer), (300,), generator=torch.Generator().manual_seed(3)).tolist()
    decoded = []

    def decode(part: list[int]) -> str:
        decoded.append(len(part))
        return tokenizer.decode(part, skip_special_tokens=True)

    detokenizer = Detokenizer(decode)
    for n in range(1, len(ids) + 1):
        assert detokenizer.text(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True), n
    steps = len(ids)
    assert ids_from == "random" or not detokenizer.whole  # real text: incremental throughout
    if not detokenizer.whole:  # a typical step decodes only the newest tokens; the whole, once every EVERY tokens
        assert sorted(decoded)[len(decoded) // 2] <= EVERY + 2 * OVERLAP
        assert sum(decoded) < steps * (steps + 1) / 2 / 2


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_the_engines_decode_is_the_tokenizers(name, monkeypatch):
    """`decoder`: the text of `tokenizer.decode(ids, skip_special_tokens=True)` for text, random ids and special
    tokens, through the Rust tokenizer directly where transformers' decode would only check the ids first (the
    bundled tokenizers), so the engine never runs that check per token; a tokenizer that cleans up spaces keeps
    transformers' decode."""
    tokenizer = bundled(name)
    gen = torch.Generator().manual_seed(5)
    special = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id) if t is not None]
    random = torch.randint(0, len(tokenizer), (200,), generator=gen).tolist()
    marked = special + tokenizer.encode("a b", add_special_tokens=False) + special
    cases = [tokenizer.encode(TEXT, add_special_tokens=True), random, marked, []]
    decode = decoder(tokenizer)
    for ids in cases:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    checked = []
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, *a, **k: checked.append(a) or "")
    decode(cases[0])
    assert not checked  # the direct route
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    decoder(tokenizer)(cases[0])
    assert checked  # cleaning up spaces: transformers' own decode

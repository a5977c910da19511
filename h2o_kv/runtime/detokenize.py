"""A request's text after each new token, without decoding all of its tokens again.

Decoding every token so far at each step (`tokenizer.decode(ids)`) makes a long answer's steps slower and slower:
the engine's host work grows with the answer's length while the GPU waits. `Detokenizer` decodes only the newest
tokens, after an anchor: the text up to the anchor is kept, and the tokens from `OVERLAP` before it are decoded
again (a token's text can depend on the one before it: SentencePiece's leading space, a UTF-8 character split
over two byte tokens) and the anchor's part of that cut off. Every `EVERY` tokens the anchor moves forward, and the
move is checked against a whole decode: a tokenizer whose text is not local there is decoded whole from then on.
So the text is `decode(ids)` wherever it was checked, and the caller decodes the last one whole anyway.
`decoder` gives the engine its `decode`: the Rust tokenizer's own where that is what transformers' `decode` runs.
"""

from __future__ import annotations

from collections.abc import Callable


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` for a list of token ids. For a fast tokenizer whose `_decode`
    is transformers' own and cleans up no spaces, that is its Rust tokenizer's `decode` of the list, called here
    directly: the same text without transformers' check of every id first (`to_py_obj`, a Python loop over the
    list, several times the Rust decode's cost, and most of the engine's host work per generated token)."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
        and backend is not None
    )
    if plain:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


OVERLAP = 6  # tokens before the anchor decoded again with the new ones
EVERY = 32  # new tokens between two moves of the anchor (each move decodes the whole text once, to check it)


class Detokenizer:
    """`text(ids)`: `decode(ids)` for a token list that each call extends."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.anchor, self.anchor_text, self.head = 0, "", ""  # tokens before the anchor, their text, its overlap's
        self.whole = False  # the anchor's check failed once: decode everything every time

    def text(self, ids: list[int]) -> str:
        if self.whole:
            return self.decode(ids)
        if len(ids) - self.anchor >= EVERY + OVERLAP:
            return self._move(ids)
        tail = self.decode(ids[max(0, self.anchor - OVERLAP) :])
        if not tail.startswith(self.head):  # the tokens after the anchor changed its text: not local here
            self.whole = True
            return self.decode(ids)
        return self.anchor_text + tail[len(self.head) :]

    def _move(self, ids: list[int]) -> str:
        """The whole text, and the anchor moved to `OVERLAP` tokens before the end, or up to `OVERLAP` more tokens back
        so that the overlap's text does not end inside a character (a byte token's "\ufffd"), if the text is local
        there; else decoded whole from now on."""
        whole = self.decode(ids)
        for anchor in range(len(ids) - OVERLAP, len(ids) - 2 * OVERLAP, -1):
            head = self.decode(ids[anchor - OVERLAP : anchor])
            if not head.endswith("\ufffd"):
                tail, anchor_text = self.decode(ids[anchor - OVERLAP :]), self.decode(ids[:anchor])
                if tail.startswith(head) and anchor_text + tail[len(head) :] == whole:
                    self.anchor, self.anchor_text, self.head = anchor, anchor_text, head
                    return whole
                break
        self.whole = True
        return whole

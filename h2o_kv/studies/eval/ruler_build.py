"""How each RULER-style prompt is built: templates, the haystack filler, and fitting a prompt to a length.

The public entry points are in `ruler.py` (`make_sample`, `make_dataset`); this module holds the
per-task builders they call (`passkey`, `niah`, `variable_tracking`, `common_words`), each returning
the prompt, its gold answers, its token count and metadata.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections.abc import Callable
from typing import Any

_PASSKEY_HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
_PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
_PASSKEY_PREFIX = "The pass key is"

_NIAH_HEADER = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)
_NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_NIAH_QUESTION = "What are all the special magic {kind} for {key} mentioned in the provided text?"
_NIAH_PREFIX = "The special magic {kind} for {key} mentioned in the provided text are"

_VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
# RULER's prefix has the typo "assgined"; fixed here, it does not change what is being asked.
_VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{n} variables are assigned the value {value}, they are:"
)

_CWE_HEADER = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
_CWE_QUESTION = "Question: What are the {k} most common words in the above list?"
_CWE_PREFIX = "Answer: The top {k} words that appear most often in the list are:"

# Needle keys are "adjective-noun" pairs as in RULER (which draws them from the wonderwords lists); a
# fixed built-in list keeps generation offline and independent of the haystack.
_ADJECTIVES = (
    "abundant agreeable ancient bitter brave bright calm careful clever cloudy crooked curious damp "
    "eager elegant fancy fierce gentle gloomy grumpy hollow humble icy jolly lively lonely loud lucky "
    "mellow misty narrow nimble noisy odd polite proud quiet rapid rusty scarce shiny silent sleepy "
    "slim smooth spicy steep sticky stormy sturdy swift tame tender tidy tiny vast wary witty zealous"
).split()
_NOUNS = (
    "anchor apple badge barrel basket beacon blanket bottle bridge bucket candle canyon carpet castle "
    "cellar chimney compass cottage crater crystal desert feather fiddle forest fountain garden glacier "
    "hammer harbor helmet island jacket kettle ladder lantern meadow mirror needle orchard paddle "
    "pebble pillow planet pocket puzzle quarry ribbon saddle shadow shelter spoon tablet thimble "
    "tunnel valley violin wagon whistle window"
).split()

_SENTENCE_END_RE = re.compile(r"[.!?][\"'’”)\]]*$")
_VOCAB_RE = re.compile(r"[a-z]+")
_CALL_BUDGET = 16  # tokenizer_len calls spent searching for the filler size, beyond the first two

_TokLen = Callable[[str], int]
_Built = tuple[str, list[str], int, dict[str, Any]]  # prompt, answers, prompt tokens, metadata


class Filler:
    """The haystack as a cyclic word stream starting at a (seeded) random sentence start.

    Working in words keeps the size search fine-grained (one word, not one sentence) while still
    letting needles snap to nearby sentence boundaries so they do not split a sentence.
    """

    def __init__(self, haystack: str, rng: random.Random) -> None:
        words = haystack.split()
        if not words:
            raise ValueError("haystack is empty")
        starts = [0] + [i + 1 for i, w in enumerate(words[:-1]) if _SENTENCE_END_RE.search(w)]
        s = rng.choice(starts)
        self.words = words[s:] + words[:s]
        # boundary[i]: a sentence starts at word i (word 0 does by construction, so cycles restart cleanly).
        ends = [bool(_SENTENCE_END_RE.search(w)) for w in self.words]
        self._boundary = [True] + ends[:-1]

    def take(self, n: int) -> list[str]:
        reps = -(-n // len(self.words))
        return (self.words * reps)[:n]

    def is_boundary(self, i: int) -> bool:
        return self._boundary[i % len(self.words)]

    def snap(self, frac: float, n: int) -> int:
        """Word index for depth ``frac`` of an ``n``-word filler, moved to the nearest sentence start
        within a small window (else kept exact): monotone in ``frac``, so chains keep their order."""
        target = round(frac * n)
        window = max(25, n // 50)
        for d in range(window + 1):
            for i in (target - d, target + d):
                if 0 <= i <= n and (i in (0, n) or self.is_boundary(i)):
                    return i
        return target

    def tokens_per_word(self, tokenizer_len: Callable[[str], int]) -> float:
        sample = self.words[:2000]
        return max(tokenizer_len(" ".join(sample)) / len(sample), 1e-3)


def _insert(words: list[str], items: list[tuple[int, int, str]]) -> str:
    """Join ``words`` with each ``(position, order, text)`` item inserted before word ``position``."""
    out: list[str] = []
    prev = 0
    for pos, _, text in sorted(items):
        out.extend(words[prev:pos])
        out.append(text)
        prev = pos
    out.extend(words[prev:])
    return " ".join(out)


def _fit(
    render: Callable[[int], str],
    tokenizer_len: Callable[[str], int],
    context_tokens: int,
    unit_tokens: float,
    max_units: int | None = None,
) -> tuple[int, str, int]:
    """Largest unit count ``n`` whose ``render(n)`` is at most ``context_tokens`` tokens (approximately).

    One call for the fixed overhead, then guesses by interpolation (secant over the bracket once one
    exists) with at most ``_CALL_BUDGET`` further ``tokenizer_len`` calls; stops once within 0.5%.
    Returns ``(n, prompt, n_tokens)`` of the best prompt that fits.
    """
    base = render(0)
    t0 = tokenizer_len(base)
    if t0 > context_tokens:
        raise ValueError(
            f"context_tokens={context_tokens} is too small: the prompt without filler already has {t0} tokens"
        )
    tol = max(1, context_tokens // 200)
    lo, t_lo, p_lo = 0, t0, base
    hi: int | None = None if max_units is None else max_units + 1
    t_hi = math.inf
    slope = unit_tokens
    aim = context_tokens - tol / 2
    guess = int((aim - t0) / slope)
    for _ in range(_CALL_BUDGET):
        if context_tokens - t_lo <= tol or (hi is not None and hi - lo <= 1):
            break
        n = max(guess, lo + 1)
        if hi is not None:
            n = min(n, hi - 1)
        p = render(n)
        t = tokenizer_len(p)
        if t <= context_tokens:
            lo, t_lo, p_lo = n, t, p
        else:
            hi, t_hi = n, t
        if hi is not None and math.isfinite(t_hi):
            slope = max((t_hi - t_lo) / (hi - lo), 1e-6)
        elif lo > 0:
            slope = max((t_lo - t0) / lo, 1e-6)
        guess = lo + max(1, int((aim - t_lo) / slope))
        if hi is not None and guess >= hi:
            guess = (lo + hi) // 2
    return lo, p_lo, t_lo


def _value(rng: random.Random, value_kind: str, digits: int) -> str:
    if value_kind == "number":
        return str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    if value_kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"value_kind must be 'number' or 'uuid', got {value_kind!r}")


def _distinct(draw: Callable[[], str], n: int, taken: set[str] | None = None) -> list[str]:
    seen = set(taken or ())
    out: list[str] = []
    while len(out) < n:
        v = draw()
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def check_depth(depth: float | None, rng: random.Random) -> float:
    if depth is None:
        return rng.random()
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return float(depth)


def passkey(rng: random.Random, filler: Filler, tpw: float, tokenizer_len: _TokLen, context_tokens: int, depth: float,
            value_kind: str) -> _Built:  # fmt: skip
    value = _value(rng, value_kind, digits=5)
    needle = _PASSKEY_NEEDLE.format(value=value)
    tail = f"What is the pass key? {_PASSKEY_PREFIX}"

    def render(n: int) -> str:
        words = filler.take(n)
        context = _insert(words, [(filler.snap(depth, n), 0, needle)])
        return f"{_PASSKEY_HEADER}\n\n{context}\n\n{tail}"

    n, prompt, t = _fit(render, tokenizer_len, context_tokens, tpw)
    meta = {
        "answer_prefix": _PASSKEY_PREFIX,
        "needle": needle,
        "needle_depth_actual": _actual(filler, depth, n),
    }
    return prompt, [value], t, meta


def _actual(filler: Filler, depth: float, n: int) -> float:
    return filler.snap(depth, n) / n if n else 0.0


def niah(rng: random.Random, filler: Filler, tpw: float, tokenizer_len: _TokLen, context_tokens: int, depth: float,
         value_kind: str, num_keys: int) -> _Built:  # fmt: skip
    kind = "numbers" if value_kind == "number" else "uuids"
    pairs = [(a, b) for a in _ADJECTIVES for b in _NOUNS]
    keys = [f"{a}-{b}" for a, b in rng.sample(pairs, num_keys)]
    values = _distinct(lambda: _value(rng, value_kind, digits=7), num_keys)
    depths = [depth] + [rng.random() for _ in range(num_keys - 1)]
    needles = [_NIAH_NEEDLE.format(kind=kind, key=k, value=v) for k, v in zip(keys, values, strict=True)]
    order = list(range(num_keys))
    rng.shuffle(order)  # tie-break among needles landing on the same word
    prefix = _NIAH_PREFIX.format(kind=kind, key=keys[0])
    tail = f"{_NIAH_QUESTION.format(kind=kind, key=keys[0])} {prefix}"
    header = _NIAH_HEADER.format(kind=kind)

    def render(n: int) -> str:
        words = filler.take(n)
        items = [(filler.snap(d, n), o, nd) for d, o, nd in zip(depths, order, needles, strict=True)]
        return f"{header}\n{_insert(words, items)}\n{tail}"

    n, prompt, t = _fit(render, tokenizer_len, context_tokens, tpw)
    meta = {
        "answer_prefix": prefix,
        "query_key": keys[0],
        "needle": needles[0],
        "needle_depth_actual": _actual(filler, depth, n),
        "distractor_keys": keys[1:],
        "distractor_values": values[1:],
        "distractor_depths": depths[1:],
        "value_kind": value_kind,
    }
    return prompt, [values[0]], t, meta


def variable_tracking(
    rng: random.Random,
    filler: Filler,
    tpw: float,
    tokenizer_len: _TokLen,
    context_tokens: int,
    num_chains: int,
    num_hops: int,
) -> _Built:
    # Variable names must not occur in the haystack, else a name could be "found" in the filler.
    taken = {w.strip(".,;:!?'\"()[]").upper() for w in filler.words}
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = _distinct(lambda: "".join(rng.choices(letters, k=5)), num_chains * (num_hops + 1), taken)
    values = _distinct(lambda: str(rng.randint(10000, 99999)), num_chains)
    chains: list[list[str]] = []
    items_frac: list[tuple[float, int, str]] = []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        chains.append(vs)
        stmts = [f"VAR {vs[0]} = {values[c]}."] + [f"VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(num_hops)]
        fracs = sorted(rng.random() for _ in stmts)
        items_frac += [(f, h * num_chains + c, s) for h, (f, s) in enumerate(zip(fracs, stmts, strict=True))]
    prefix = _VT_PREFIX.format(n=num_hops + 1, value=values[0])
    tail = f"{_VT_QUESTION.format(value=values[0])} {prefix}"

    def render(n: int) -> str:
        items = [(filler.snap(f, n), o, s) for f, o, s in items_frac]
        return f"{_VT_HEADER}\n\n{_insert(filler.take(n), items)}\n{tail}"

    n, prompt, t = _fit(render, tokenizer_len, context_tokens, tpw)
    meta = {"answer_prefix": prefix, "query_value": values[0], "chains": chains, "chain_values": values}
    return prompt, list(chains[0]), t, meta


def common_words(
    rng: random.Random,
    haystack: str,
    tokenizer_len: _TokLen,
    context_tokens: int,
    num_common: int,
    common_freq: int | None,
    uncommon_freq: int,
) -> _Built:
    vocab = list(dict.fromkeys(w for w in _VOCAB_RE.findall(haystack.lower()) if len(w) >= 3))
    if len(vocab) < num_common + 1:
        raise ValueError(f"haystack has only {len(vocab)} distinct words; common_words needs more")
    if common_freq is None:
        # RULER uses 30 repeats at 4K+; shorter contexts cannot hold 10 x 30 items, so scale down while
        # keeping the common words clearly more frequent than the uncommon ones.
        common_freq = max(uncommon_freq + 3, min(30, context_tokens // 128))
    if common_freq <= uncommon_freq:
        raise ValueError(f"common_freq ({common_freq}) must exceed uncommon_freq ({uncommon_freq})")
    rng.shuffle(vocab)
    common, pool = vocab[:num_common], vocab[num_common:]
    shuffle_seed = rng.getrandbits(64)
    prefix = _CWE_PREFIX.format(k=num_common)
    tail = f"{_CWE_QUESTION.format(k=num_common)} {prefix}"

    def render(n: int) -> str:
        items = common * common_freq + pool[:n] * uncommon_freq
        random.Random(shuffle_seed + n).shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return f"{_CWE_HEADER}\n{listing}\n{tail}"

    probe = " ".join(f"{1000 + i}. {w}" for i, w in enumerate(pool[:200]))
    unit = max(tokenizer_len(probe) / len(pool[:200]), 1e-3) * uncommon_freq
    n, prompt, t = _fit(render, tokenizer_len, context_tokens, unit, max_units=len(pool))
    if n == len(pool) and context_tokens - t > max(1, context_tokens // 20):
        raise ValueError(
            f"haystack vocabulary ({len(vocab)} distinct words) is too small for common_words at "
            f"context_tokens={context_tokens}; pass a larger haystack or a larger uncommon_freq"
        )
    meta = {
        "answer_prefix": prefix,
        "common_freq": common_freq,
        "uncommon_freq": uncommon_freq,
        "num_uncommon": n,
    }
    return prompt, list(common), t, meta

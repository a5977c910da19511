"""Policy names and the one budget rule: what a flag, a request or a constructor may say, without torch (the
CLI parses its flags before importing torch)."""

from __future__ import annotations

from h2o_kv.errors import BadBudget, UnknownPolicy

MAX_TOKENS = 1 << 40  # a token count beyond this cannot mean anything real (and would overflow int64 sums)

#: A fraction of the prompt that resolves to fewer tokens per (sequence, KV head) than this is warned about (not
#: raised: the paper's semantics, int(ratio x prompt length), stay); below it generated text drifts off topic
FRACTION_FLOOR = 16

NAMES = (
    "h2o",
    "snapkv",
    "adakv",
    "pyramidkv",
    "globalkv",
    "local",
    "streamingllm",
    "tova",
    "keydiff",
    "kvzip",
    "kvzipwhole",
    "kvziplayer",
    "kvzipwindow",
    "kvziplayerwindow",
    "full",
)
DEFAULT = "globalkv"  # generate's, demo's and the engine's default: docs/accuracy.md's best for a prompt read whole
#: `serve`'s default: it reads a prompt in chunks, and a KVzip pass holds them all before it ranks, so the question at
#: the prompt's end is read before anything goes (GlobalKV evicts between chunks, before it: results/defaults); the
#: window keeps what that question asks about, and the whole-cache ranking keeps what a later question (a next turn
#: from --session-memory) needs (docs/accuracy.md, compress once); its requests batch where their layers fit kv_memory
SERVE_DEFAULT = "kvzipwindow"

Budget = float | int | None  # None: the Full cache


def is_fraction(budget: Budget) -> bool:
    """A float budget is a fraction of the prompt; an int is a token count."""
    return isinstance(budget, float)


def check_budget_value(budget: Budget, what: str = "budget") -> None:
    """The one rule for budgets: an int >= 1 is tokens, a float in (0, 1] is a fraction of the prompt; BadBudget
    otherwise (TypeError for what is not a number at all, as a constructor's fields)."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"{what} must be an int token count or a float fraction in (0, 1], got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:  # nan and inf fail here too
            raise BadBudget(
                f"{what} {budget!r} means nothing: a float is a fraction of the prompt in (0, 1], an int is tokens"
            )
    elif not 1 <= budget <= MAX_TOKENS:
        raise BadBudget(f"{what} as tokens must be in [1, {MAX_TOKENS}], got {budget}")


def parse_budget(text: str) -> int | float:
    """Text from a flag or a request: "64" is 64 tokens; "0.2" or "20%" is a fraction of the prompt.

    "1" is one token and "1.0" the whole prompt; "1.5", "0", "inf" and "nan" are refused.
    """
    s = str(text).strip()
    try:
        if s.endswith("%"):
            budget: int | float = float(s[:-1]) / 100
        elif s.lstrip("+-").isdigit():
            budget = int(s)
        else:
            budget = float(s)
    except ValueError:
        raise BadBudget(
            f"budget {text!r} is not a number: give tokens (64) or a fraction of the prompt (0.2)"
        ) from None
    check_budget_value(budget)
    return budget


def budget_tokens(budget: Budget, length: int) -> int | None:
    """Tokens kept per (sequence, KV head) for a budget at a prompt length (None: unbounded).

    A fraction f gives max(1, int(f * length)), as the paper's int(ratio * L); an int is itself.
    """
    if budget is None:
        return None
    check_budget_value(budget)
    if is_fraction(budget):
        return max(1, int(budget * length))
    return int(budget)


def policy_key(name: str) -> str:
    """`name` as one of NAMES (case, "-" and "_" ignored: "StreamingLLM", "streaming-llm"); UnknownPolicy (a
    ValueError) if none."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in NAMES:
        raise UnknownPolicy(name, NAMES)
    return key


def short_fraction(described: str, kept: int, prompt_len: int) -> str | None:
    """The warning for a policy sized as a fraction of the prompt that keeps `kept` tokens per (sequence, KV head)
    of a `prompt_len`-token prompt: None unless that is under FRACTION_FLOOR and evicts."""
    if kept >= FRACTION_FLOOR or kept >= prompt_len:
        return None
    return (f"{described} keeps {kept} tokens per (sequence, KV head) of this {prompt_len}-token prompt, too few for "
            f"coherent text: give a token budget (such as 64) or a larger fraction")  # fmt: skip

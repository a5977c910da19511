"""From a validated request body to what the engine needs: prompt ids, KV policy and budget, token limit.

Every refusal is an `ApiError` naming the request field, checked with the same rules as the CLI
(`policies.parse_budget` / `policies.build`), so the engine only ever sees input it accepts. The library's typed
refusals (`h2o_kv.errors`) become HTTP errors by their type (`refusal`), never by their text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv import policies
from h2o_kv.errors import BadBudget, ContextTooLong, InputError, KVMemoryExceeded, UnknownPolicy
from h2o_kv.runtime.generation import encode


class ApiError(Exception):
    """An HTTP error with OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def prompt_ids(tokenizer, prompt: str | list[int], *, vocab_size: int) -> list[int]:
    """Token ids of a completions prompt: text (tokenized as is, no chat template) or ids checked in range."""
    if isinstance(prompt, str):
        try:
            return encode(tokenizer, prompt, chat=False)
        except ValueError as err:
            raise ApiError(400, f"prompt: {err}", param="prompt") from None
    if not prompt:
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    return list(prompt)


NEXT_TURN = "..."  # a next user message's stand-in: what a turn resends is read up to its text


def chat_resend(tokenizer, messages: list[dict]):
    """`Engine.submit`'s `resend` for a chat request: given its answer's text, the ids of the conversation as a
    client sends it back, with the answer as an assistant message and a next user message (`NEXT_TURN`), rendered by
    the model's template. A template that rewrites earlier turns (reasoning dropped from the history) rewrites them
    here too, so the prefix store keeps the cache that next turn can extend."""

    def resend(answer: str) -> list[int]:
        history = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": NEXT_TURN}]
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return resend


def text_resend(tokenizer, prompt: str):
    """`Engine.submit`'s `resend` for a text completion: the prompt and the answer's text, tokenized as a client's
    next request that sends them back (the answer's ids may tokenize otherwise)."""
    return lambda answer: encode(tokenizer, prompt + answer, chat=False)


def _budget(value: str | float | int) -> policies.Budget:
    """kv_budget from JSON: a string as the CLI's --budget, a number as policies.build takes it."""
    if isinstance(value, str):
        return policies.parse_budget(value)
    policies.check_budget_value(value, "kv_budget")
    return value


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (each a `serve` flag): its body's bytes (413 beyond), its prompt's
    tokens and its new tokens (400 beyond; None: the model's context), how many requests may wait for the
    engine (429 with Retry-After beyond), and the seconds a client may take to send its request (408) or leave
    a stream unread (the request is cancelled): timeouts.py."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_new_tokens: int = 4096
    max_queue: int = 256
    read_timeout: float = 30.0
    stream_timeout: float = 60.0


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Job:
    """What one request asks of the engine: its policy, built once here (the engine's defaults overridden by
    kv_policy and kv_budget) and submitted as is, its token limit, and the reply's `kv_warning` when its budget
    keeps very few tokens of its prompt."""

    policy: policies.Policy
    max_tokens: int
    warning: str | None = None


def resolve(engine, body, ids: list[int], limits: Limits = DEFAULT_LIMITS, *, prompt_param: str = "prompt") -> Job:
    """Check the request's KV policy, budget and token limits (the model's context and the server's `limits`);
    refusals are ApiErrors naming the field (`prompt_param`: "messages" for a chat).

    The policy is built as the engine would (`engine.resolve_policy`: the server's defaults, overridden by
    kv_policy and kv_budget) and goes to `engine.submit` built, so a request the engine would refuse is refused
    here. The prompt's own length against the context and the KV memory is the engine's check (`submit`).
    """
    budget = None
    if body.kv_budget is not None:
        try:
            budget = _budget(body.kv_budget)
        except (ValueError, TypeError) as err:
            raise ApiError(400, f"kv_budget: {err}", param="kv_budget") from None
    try:
        policy = engine.resolve_policy(body.kv_policy, budget)
    except (UnknownPolicy, BadBudget) as err:
        raise refusal(err, prompt_param=prompt_param) from None
    except (ValueError, TypeError) as err:  # a policy's own check of the size the budget gave it
        raise ApiError(400, f"kv_budget: {err}", param="kv_budget") from None
    if body.kv_inspect and body.stream:
        raise ApiError(400, "kv_inspect: the kept map comes with a whole answer; set stream to false",
                       param="kv_inspect")  # fmt: skip
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens} "
                       "(--max-prompt-tokens)", param="prompt", code="prompt_too_long")  # fmt: skip
    context = engine.context_limit
    limit = body.token_limit()
    if limit is None:
        limit = max(1, min(context - len(ids), limits.max_new_tokens))
    elif limit > context:
        raise ApiError(
            400, f"max_tokens {limit} is more than the model's context of {context} tokens", param="max_tokens"
        )
    elif limit > limits.max_new_tokens:
        raise ApiError(400, f"max_tokens {limit} is more than this server's cap of {limits.max_new_tokens} "
                       "(--max-new-tokens)", param="max_tokens")  # fmt: skip
    if engine.waiting() >= limits.max_queue:
        raise ApiError(429, f"{limits.max_queue} requests are already waiting (--max-queue): retry shortly",
                       type="server_error", code="queue_full")  # fmt: skip
    return Job(policy=policy, max_tokens=limit, warning=_kv_warning(policy, len(ids)))


def _kv_warning(policy: policies.Policy, prompt_len: int) -> str | None:
    """`policies.short_fraction`'s warning for a request whose policy, sized as a fraction of the prompt, keeps
    very few tokens of this prompt (the response says it in `kv_warning` and the X-KV-Warning header)."""
    if not policy.fraction_of_prompt():
        return None
    kept = policy.capacity(torch.tensor([prompt_len]))
    return None if kept is None else policies.short_fraction(policy.describe(), int(kept.min()), prompt_len)


def refusal(err: ValueError, *, prompt_param: str) -> ApiError:
    """The 400 for a refusal of the policies or the engine (`submit`), by the error's type: the request's field
    in `param` (`prompt_param`: "prompt", or "messages" for a chat) and OpenAI's code where it has one."""
    message = str(err)
    if isinstance(err, UnknownPolicy):
        return ApiError(400, f"kv_policy: {message}", param="kv_policy")
    if isinstance(err, BadBudget):
        return ApiError(400, f"kv_budget: {message}", param="kv_budget")
    if isinstance(err, ContextTooLong):
        return ApiError(400, f"{prompt_param}: {message}", param=prompt_param, code="context_length_exceeded")
    if isinstance(err, KVMemoryExceeded):
        return ApiError(400, message, param=prompt_param, code="kv_memory_exceeded")
    if isinstance(err, InputError):  # the library's name of the field, as the request's
        fields = {"prompt": prompt_param, "policy": "kv_policy", "budget": "kv_budget"}
        return ApiError(400, message, param=fields.get(err.param, err.param))
    return ApiError(400, message)

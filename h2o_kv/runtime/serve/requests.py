"""From a validated request body to what the engine needs: prompt ids, KV policy and budget, token limit.

Every refusal is an `ApiError` naming the request field, checked with the same rules as the CLI
(`policies.parse_budget` / `policies.build`), so the engine only ever sees input it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_kv import policies
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
    """What one request asks of the engine (policy/budget None: the engine's defaults), and the reply's
    `kv_warning` when its budget keeps very few tokens of its prompt."""

    policy: str | None
    budget: policies.Budget
    max_tokens: int
    warning: str | None = None


def resolve(engine, body, ids: list[int], limits: Limits = DEFAULT_LIMITS) -> Job:
    """Check the request's KV policy, budget and token limits (the model's context and the server's `limits`);
    refusals are ApiErrors naming the field.

    The policy is resolved as the engine will (`engine.resolve_policy`: the server's defaults,
    overridden by kv_policy and kv_budget), so a request the engine would refuse is refused here.
    """
    budget = None
    if body.kv_budget is not None:
        try:
            budget = _budget(body.kv_budget)
        except (ValueError, TypeError) as err:
            raise ApiError(400, f"kv_budget: {err}", param="kv_budget") from None
    try:
        policy = engine.resolve_policy(body.kv_policy, budget)
    except (ValueError, TypeError) as err:
        param = "kv_policy" if str(err).startswith("unknown policy") else "kv_budget"
        raise ApiError(400, f"{param}: {err}", param=param) from None
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
    return Job(policy=body.kv_policy, budget=budget, max_tokens=limit, warning=_kv_warning(policy, len(ids)))


def _kv_warning(policy: policies.Policy, prompt_len: int) -> str | None:
    """`policies.short_fraction`'s warning for a request whose policy, sized as a fraction of the prompt, keeps
    very few tokens of this prompt (the response says it in `kv_warning` and the X-KV-Warning header)."""
    if not policy.fraction_of_prompt():
        return None
    kept = policy.capacity(torch.tensor([prompt_len]))
    return None if kept is None else policies.short_fraction(policy.describe(), int(kept.min()), prompt_len)


def submit_error(err: ValueError, *, prompt_param: str) -> ApiError:
    """The engine's refusal of a request that passed `resolve` (too long for the context or for the KV memory)."""
    message = str(err)
    if "context" in message:
        return ApiError(400, f"{prompt_param}: {message}", param=prompt_param, code="context_length_exceeded")
    if "KV cache" in message:
        return ApiError(400, message, param=prompt_param, code="kv_memory_exceeded")
    return ApiError(400, message)

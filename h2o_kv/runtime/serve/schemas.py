"""Request bodies and response payloads of the OpenAI-compatible API (the fields h2o-kv serves).

Requests are pydantic models: a wrong type or an out-of-range number becomes a 400 with an
OpenAI-shaped error naming the field. Unknown fields are ignored, as clients send many; fields
that ask for something this server cannot do (n > 1, logprobs, echo, best_of, suffix, tools) are refused.
Responses are plain dicts in the shape the `openai` client parses.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from h2o_kv.policies.budget import NAMES

POLICY_FIELD = f"the KV policy, one of {', '.join(NAMES)} (h2o-kv extension; the server's --policy by default)"

MAX_STOP = 4  # OpenAI's limit on stop sequences


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: OpenAI's default 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list after validation
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    user: str | None = None
    kv_policy: str | None = Field(None, description=POLICY_FIELD)
    kv_budget: str | float | int | None = Field(None, description="tokens (64) or a prompt fraction (0.2 or '20%')")
    ignore_eos: StrictBool = False  # generate exactly max_tokens (benchmarks; as vLLM's extension)
    # the reply's `kv_inspect`: which cached rows still held each prompt position at the end (`KeptMap.summary`)
    kv_inspect: StrictBool = Field(False, description="return the kept map with the answer (h2o-kv extension)")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Request):
    """POST /v1/completions. One prompt: a string, or a list of one string or of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported, got a batch of {len(prompt)}")
            return prompt[0]
        return prompt

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value not in (None, False, 1):
            raise ValueError(f"{info.field_name} is not supported")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as the tokenizer's chat template takes it (text parts joined, developer -> system)."""
        content = self.content if isinstance(self.content, str) or self.content is None else ""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Request):
    """POST /v1/chat/completions. `max_completion_tokens` (the newer name) wins over `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools):
        if tools:
            raise ValueError("tools are not supported")
        return None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# Responses -------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens a kept cache had seen (not prefilled again)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "h2o-kv"}


def completion(id: str, model: str, text: str, finish_reason: str, use: dict[str, int]) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(id, "text_completion", model, [choice], use)


def chat_completion(id: str, model: str, text: str, finish_reason: str, use: dict[str, int]) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(id, "chat.completion", model, [choice], use)


def completion_chunk(id: str, model: str, text: str, finish_reason: str | None, with_usage: bool) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _chunk(id, "text_completion", model, [choice], with_usage)


def chat_chunk(id: str, model: str, delta: dict, finish_reason: str | None, with_usage: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _chunk(id, "chat.completion.chunk", model, [choice], with_usage)


def usage_chunk(id: str, object: str, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return _envelope(id, object, model, [], use)


def _chunk(id: str, object: str, model: str, choices: list, with_usage: bool) -> dict[str, Any]:
    body = _envelope(id, object, model, choices, None)
    if not with_usage:
        del body["usage"]
    return body


def _envelope(id: str, object: str, model: str, choices: list, use: dict[str, int] | None) -> dict[str, Any]:
    return {"id": id, "object": object, "created": int(time.time()), "model": model, "choices": choices, "usage": use}

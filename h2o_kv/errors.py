"""The errors h2o-kv raises for input it refuses, typed so that callers (the server, the CLI) map them by type.

Each is a `ValueError` (what the library raised before they had types) and names the parameter at fault in
`param`, in the library's words ("prompt", "max_tokens", "policy", "budget"): the server turns that into its own
field name and HTTP code (`runtime/serve/requests.py`), the CLI into one line and exit 2. No torch here: the CLI
imports this before it parses its arguments.
"""

from __future__ import annotations


class InputError(ValueError):
    """A request or setting h2o-kv refuses; `param` names what to change."""

    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class UnknownPolicy(InputError):
    """A policy name that is none of `policies.NAMES`."""

    param = "policy"

    def __init__(self, name: str, choices: tuple[str, ...]) -> None:
        super().__init__(f"unknown policy {name!r}; choose from {', '.join(choices)}")
        self.name, self.choices = name, choices


class BadBudget(InputError):
    """A budget a policy cannot take (missing, out of range, or given to Full)."""

    param = "budget"


class ContextTooLong(InputError):
    """A prompt (and the tokens asked for after it) past the model's context: positions it was never trained on."""

    param = "prompt"

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int, context: int) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context


class KVMemoryExceeded(InputError):
    """A request whose KV cache can grow past the engine's `kv_memory`, so that it could never be admitted."""

    param = "prompt"

    def __init__(self, message: str, *, needed: int, allowed: int) -> None:
        super().__init__(message)
        self.needed, self.allowed = needed, allowed

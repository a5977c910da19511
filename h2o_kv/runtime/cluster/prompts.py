"""The gateway's view of a request's prompt: the token ids the replica's app will compute for it, fingerprinted for
the router (affinity.Prompt).

The gateway loads the model's tokenizer (not the model) and tokenizes completions and chat completions as
`serve.app` does: the same request schemas, `requests.prompt_ids` for a completion's prompt, the tokenizer's chat
template with the generation prompt for messages. So the ids, and the kept prefixes they match, are exactly the
replica's. This costs a second tokenization per request (the replica's app tokenizes again), done on one worker
thread of the gateway, off its event loop; it is small next to the prefill it can save.

A body the replica's app will refuse (not JSON, a field out of range, no chat template) gets no fingerprint: the
router places it by room, and the replica answers it with its 400.
"""

from __future__ import annotations

import json

from jinja2 import TemplateError
from pydantic import ValidationError

from h2o_kv.runtime.cluster.affinity import Prompt
from h2o_kv.runtime.serve import schemas
from h2o_kv.runtime.serve.requests import ApiError, prompt_ids

ROUTES = {"/v1/completions": schemas.CompletionRequest, "/v1/chat/completions": schemas.ChatRequest}
ID_RANGE = 1 << 32  # fingerprints pack ids as 32-bit numbers; the replica checks them against its vocabulary


def load_tokenizer(model: str):
    """The tokenizer the replicas load for `model` (a bundled name, a folder, a .gguf file or a hub id)."""
    from h2o_kv.runtime import models

    return models.load_tokenizer(model)


def token_ids(tokenizer, path: str, body: bytes) -> list[int] | None:
    """The prompt ids the replica's app computes for a POST to `path` with `body`; None for another route or a body
    it refuses."""
    schema = ROUTES.get(path)
    if schema is None:
        return None
    try:
        request = schema.model_validate(json.loads(body))
    except (ValueError, ValidationError):  # not JSON, or not a valid request: the replica's app says why
        return None
    if schema is schemas.CompletionRequest:
        try:
            return prompt_ids(tokenizer, request.prompt, vocab_size=ID_RANGE)
        except ApiError:  # an empty prompt, or ids out of range
            return None
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [message.template_dict() for message in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:  # the template refuses these messages (roles out of order): so will the replica
        return None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def fingerprint(tokenizer, path: str, body: bytes) -> Prompt | None:
    """The request's prompt fingerprints for the router (None: no prompt to match)."""
    ids = token_ids(tokenizer, path, body)
    return Prompt.of(ids) if ids else None

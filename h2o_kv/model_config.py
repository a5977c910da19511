"""Reading a Hugging Face model's config the one way h2o-kv does (no torch, no transformers import: the cache,
the engine, the server and tensor parallelism all ask it)."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The config of the language model inside `config`: its text config for a multimodal model (Gemma 3's
    `get_text_config()`: layers, heads, context, vocabulary), else `config` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config

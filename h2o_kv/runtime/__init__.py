"""Running models with the cache: loading them, prefill and decode steps, captured decode steps, the
continuous-batching engine and its admission by KV memory, the OpenAI-compatible server, tensor parallel."""

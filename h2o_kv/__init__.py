"""h2o-kv: a bounded KV cache for Hugging Face causal LMs with Heavy-Hitter Oracle eviction.

model, tokenizer = h2o_kv.load_model("smollm2-135m")
cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=64, recent=64))
model.generate(**inputs, past_key_values=cache, max_new_tokens=200)
"""

from h2o_kv.cache.attention import enable, is_enabled
from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import H2O, TOVA, AdaKV, Full, LayerBudgets, Local, Policy, Sinks, SnapKV, StreamingLLM


def load_model(*args, **kwargs):
    """Load a causal LM and its tokenizer, ready for h2o-kv (see `h2o_kv.runtime.models.load_model`)."""
    from h2o_kv.runtime.models import load_model as _load

    return _load(*args, **kwargs)


__all__ = [
    "KVCache",
    "enable",
    "is_enabled",
    "load_model",
    "Policy",
    "H2O",
    "Local",
    "StreamingLLM",
    "TOVA",
    "SnapKV",
    "AdaKV",
    "LayerBudgets",
    "Sinks",
    "Full",
    "Engine",
]


def __getattr__(name: str):
    if name == "Engine":  # h2o_kv.Engine without importing the engine for users of the cache alone
        from h2o_kv.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'h2o_kv' has no attribute {name!r}")


__version__ = "0.1.0"

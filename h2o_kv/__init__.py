"""h2o-kv: a bounded KV cache for Hugging Face causal LMs with Heavy-Hitter Oracle eviction.

model, tokenizer = h2o_kv.load_model("smollm2-135m")
cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=64, recent=64))
model.generate(**inputs, past_key_values=cache, max_new_tokens=200)

Names are imported when first used, so `import h2o_kv` (and the CLI's argument parsing) does not import torch.
"""

from h2o_kv.lazy import exports
from h2o_kv.policies import CLASSES

#: each public name and the module it lives in
_EXPORTS = {
    "KVCache": "h2o_kv.cache.kvcache",
    "enable": "h2o_kv.cache.attention",
    "is_enabled": "h2o_kv.cache.attention",
    "kept_map": "h2o_kv.cache.kept",
    "KeptMap": "h2o_kv.cache.kept",
    "load_model": "h2o_kv.runtime.models",
    "compress": "h2o_kv.runtime.compress",
    "Engine": "h2o_kv.runtime.engine",
    **{name: "h2o_kv.policies" for name in CLASSES},
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"

__getattr__ = exports(__name__, _EXPORTS)

"""The storage formats a cache takes besides the model's own dtype, and their check (no torch: the CLI's and the
server's flags name them before torch is imported)."""

from __future__ import annotations

KV_DTYPES = ("int8",)  # storage formats besides the model's own dtype (kv_dtype=None): quant.py


def check_kv_dtype(kv_dtype: object) -> None:
    """None (the model's dtype) or one of KV_DTYPES; anything else is refused with one line."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None (the model's dtype) or one of {list(KV_DTYPES)}, got {kv_dtype!r}")

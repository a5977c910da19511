"""Which backend and kernel run each attention call and each steady decode step: the one place that says so.

`choose` picks an attention call's route, `attend` runs it; `steady_route` picks a full layer's decode step
(steady.py), `native_lowest` a head-pooled row's decode eviction (pooled.py). The Triton kernels run where
`backends.use_triton` says (a GPU), h2o-kv's C++ kernels on a CPU where the cache has them (`uses_native`), torch
everywhere else. A call's route, the first that applies:

    one query that sees every kept token (a decode step)  triton_one (a head-pooled row too), native_one,
                                                          native_pooled_one, torch_one
    new tokens in order after old slots without holes      prompt_scores (Triton), attend_prompt (SDPA)
    a float32 prompt or chunk on a CPU, no window/softcap  native_prompt (C++)
    anything else                                          blocked (torch)

The routes live in attend.py (a decode step's and the blocked one) and prompt.py (a prompt's).
"""

from __future__ import annotations

import torch

from h2o_kv.backends import use_triton
from h2o_kv.cache.attend import (
    Call,
    Slots,
    blocked,
    compute_dtype,
    native_one,
    native_pooled_one,
    torch_one,
    triton_one,
)
from h2o_kv.cache.prompt import attend_prompt, native_prompt, prompt_scores

__all__ = ["Call", "Slots", "attend", "choose", "steady_route", "uses_native"]


def attend(q: torch.Tensor, kv: Slots, qpos: torch.Tensor, call: Call, *, native_kernels: bool = False):
    """Attention of new queries q [B, Hq, n, D] at positions qpos [B, n] (-1 = padding) over the slots `kv`, per KV
    head: the output [B, n, Hq, D] in q's dtype (None where `Call.want_out` lets a route skip it), and as `call` asks
    the attention each slot received [B, H, S] (float32) and the last query's. `native_kernels`: the C++ kernels may
    run (`uses_native`). bfloat16/float16 on a CPU computes in float32 (`compute_dtype`). In a head-pooled row (one
    storage row shared by the KV heads, pooled.py) a query sees only its own head's slots, so the scores summed over
    the "group" (every query head) count the slot's own group."""
    x = q.to(compute_dtype(q.dtype, q.device))
    route = choose(x, kv, call, native_kernels)
    out, scores, last = route(x, kv, qpos, call)
    if out is not None and route is not native_pooled_one:  # that kernel's output stays float32
        out = out.to(q.dtype)
    return out, scores, last


def choose(q: torch.Tensor, kv: Slots, call: Call, native_kernels: bool):
    """The route for this call, queries q in the products' dtype (the table above). A prompt's in-order shortcut
    checks the old slots for holes: a host sync."""
    n, new_from, window, softcap = q.shape[2], call.new_from, call.window, call.softcap
    triton = softcap is None and use_triton(q.device)
    if n == 1 and window is None and not call.has_padding:
        if triton:  # a head-pooled row too
            from h2o_kv.backends import triton_decode  # Triton is not a dependency of the core

            if triton_decode.supported(q, kv.keys, kv.values):
                return triton_one
        if native_kernels and kv.slot_head is None and native_rows(kv.keys, q.dtype):
            return native_one
        if native_kernels and kv.slot_head is not None and kv.keys.dtype == q.dtype == torch.float32:
            return native_pooled_one
        return torch_one
    in_order = new_from is not None and softcap is None and kv.slot_head is None and not call.has_padding
    in_order = in_order and (window is None or new_from == 0) and n > 1
    if in_order and (new_from == 0 or not bool((kv.pos[..., :new_from] < 0).any())):  # no holes
        if triton and (call.want_scores or call.want_last):
            from h2o_kv.backends import triton_scores

            if triton_scores.supported(q, kv.keys):
                return prompt_scores
        if not call.want_scores or 0 < call.score_from < n:
            return attend_prompt
    native_prompts = native_kernels and new_from is not None and window is None and softcap is None and n > 1
    if native_prompts and kv.slot_head is None and q.device.type == "cpu" and q.dtype == torch.float32:
        return native_prompt  # the storage is read as float32 products' (`attend.stored_as`)
    return blocked


def native_rows(keys: torch.Tensor, compute: torch.dtype) -> bool:
    """Whether `native.attend_one` (and `native.decode_step`) read this storage for a decode step computed in
    `compute`: int8 or bfloat16 (widened in registers, float32 products), or float32 products over float32."""
    return keys.dtype in (torch.int8, torch.bfloat16) or keys.dtype == compute == torch.float32


def uses_native(settings, device: torch.device) -> bool:
    """Whether a layer's work on `device` runs h2o-kv's C++ kernels (native.py): CPU steps, when the cache has
    them (`Settings.compile_kernel`), outside torch.compile (which traces the torch path instead)."""
    return settings.compile_kernel and device.type == "cpu" and not torch.compiler.is_compiling()


def native_lowest(settings, priority: torch.Tensor) -> bool:
    """Whether a head-pooled row's decode eviction finds its lowest priorities in one C++ pass
    (`native.lowest_slots`) rather than torch's topk, sort and compare: float32 priorities, C++ kernels here."""
    return uses_native(settings, priority.device) and priority.dtype == torch.float32


def widens(query: torch.Tensor, keys: torch.Tensor, quantized: bool, native_rows_read: bool) -> bool:
    """Whether a call's route may widen the storage into a work buffer (`attend.widen`): a decode step that no C++
    kernel reads in place (`native_rows_read`: a layer's C++ kernels over a row per KV head), over int8 storage
    (`quantized`) or storage in another dtype than the products'."""
    dtype = compute_dtype(query.dtype, query.device)
    reads_storage = native_rows_read and native_rows(keys, dtype)  # no float copy to make
    return query.shape[2] == 1 and not reads_storage and (quantized or dtype != keys.dtype)


def steady_route(layer, query: torch.Tensor, buffered: bool, softcap: float | None):
    """Which backend runs a full layer's steady decode step (steady.py), and the policy's `protected_recent` and
    `protected_sinks` it ranks by: "native", one C++ pass per row (`native.decode_step`; `pooled_decode_step` for a
    head-pooled row); "triton", `triton_evict.decode_evict` (`triton_step`); "eager" (None, None), torch's operations
    with the attention through `attend`. Both kernels need a policy ranking by the undecayed score with the newest
    tokens kept (H2O, SnapKV, KVzip), and perhaps the first ones (`Sinks` around one)."""
    policy = layer.policy
    if uses_native(layer.settings, query.device) and policy.decay == 1.0 and native_step_reads(layer, query):
        backend = "native"
    elif layer.head is None and triton_step(layer, query, buffered, softcap):
        backend = "triton"
    else:
        return "eager", None, None  # asks the policy nothing: the eager step ranks by `priority`
    state = layer.slot_state(layer.next_pos, keys=False)
    recent = policy.protected_recent(state)
    if recent is None:  # a policy's own, whichever kernel
        return "eager", None, None
    return backend, recent, policy.protected_sinks(state)


def native_step_reads(layer, query: torch.Tensor) -> bool:
    """Whether the C++ step reads this layer's storage for `query`: float32 products over float32 storage, bfloat16
    or int8 (`native_rows`); a head-pooled row's step, float32 rows with float32 queries (as `pooled_attend_one`)."""
    if layer.head is not None:
        return layer.keys.dtype == query.dtype == torch.float32
    return native_rows(layer.keys, compute_dtype(query.dtype, query.device))


def triton_step(layer, query: torch.Tensor, buffered: bool, softcap: float | None) -> bool:
    """Whether `triton_evict.decode_evict` can run this step: the Triton kernels on this device, no softcap, every
    slot holding a token (`packed`) or rows of different capacities (`ragged`: the kernel masks the empty slots), the
    new token's slots being the layer's vacant buffer (`buffered`), no `last` and undecayed scores, and shapes the
    kernel takes."""
    if softcap is not None or not (layer.packed or layer.ragged()) or not buffered:
        return False
    if layer.last is not None or layer.policy.decay != 1.0 or not use_triton(query.device):
        return False
    from h2o_kv.backends import triton_decode  # Triton is not a dependency of the core

    return triton_decode.supported(query, layer.keys, layer.values)

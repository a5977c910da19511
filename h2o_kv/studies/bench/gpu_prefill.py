"""The GPU study's cell for the engine's prefill: one long prompt read in calls of `chunk` tokens, as `Engine` reads
it, by H2O at 20 % and by `Full()` on the same path (the two policies of the serving run,
compare/gpu/serving_run.py), and where H2O's device time goes (its kernels by total time).

Why: in the serving run both policies' prefill took about the same time (34.1 and 36.6 s for 589,809 tokens on an
H200), yet H2O's later calls attend over its kept slots (20 % of what it has read) plus the call, where Full's attend
over everything before them; at 32k tokens attention is about half of a prefill's arithmetic. This cell says whether
H2O's chunked prefill is cheaper than Full's, and if not, which kernels eat the difference.
"""

from __future__ import annotations

import statistics

import torch

from h2o_kv.studies.bench.gpu_models import BUDGET, clock, sync


def prefill_chunked(model, context: int, device, chunk: int = 4096, repeats: int = 2) -> dict:
    """Seconds to read one `context`-token prompt in calls of `chunk` (median of `repeats` after one warm-up) for
    H2O at 20 % and `Full()`, and the top kernels of one H2O read (name, calls, device ms)."""
    from h2o_kv import KVCache, enable
    from h2o_kv.policies import Full, build
    from h2o_kv.runtime.generation import prefill

    enable(model)
    chunk = min(chunk, context // 4)
    ids = torch.randint(model.config.vocab_size, (1, context), device=device)
    policies = {"full": Full(), "h2o": build("h2o", int(BUDGET * context))}
    out: dict = dict(chunk=chunk)
    for name, policy in policies.items():
        read = lambda policy=policy: prefill(model, KVCache(policy), ids, chunk=chunk)  # noqa: E731
        times = [clock(device, read) for _ in range(repeats + 1)]
        out[f"{name}_s"] = statistics.median(times[1:])
    activities = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else None
    with torch.profiler.profile(activities=activities) as prof:
        prefill(model, KVCache(policies["h2o"]), ids, chunk=chunk)
        sync(device)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    out["h2o_device_ms"] = sum(e.device_time_total for e in kernels) / 1000
    out["h2o_kernels"] = [dict(name=e.key[:90], calls=e.count, ms=round(e.device_time_total / 1000, 2))
                          for e in kernels[:20]]  # fmt: skip
    return out

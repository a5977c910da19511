"""The timed loop: one prefill call, then one decode step per generated token (greedy), per configuration.

Every cache runs the same loop through `h2o_kv.generation` (prefill, decode_step), so the only
difference between rows is the cache and its attention path.
"""

from __future__ import annotations

import statistics
import time

import torch

from h2o_kv.generation import decode_step
from h2o_kv.generation import prefill as model_prefill
from h2o_kv.policies import Budget, Full

from .config import Cache, Row, describe, new_cache, policy_for
from .memory import PeakMemory, kept_and_seen, kv_bytes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model: torch.nn.Module, cache: Cache, input_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Run the prompt [B, n] through the model: (the greedy next token [B], seconds)."""
    start = time.perf_counter()
    token = model_prefill(model, cache, input_ids).argmax(-1)
    sync(input_ids.device)
    return token, time.perf_counter() - start


def decode_steps(model: torch.nn.Module, cache: Cache, token: torch.Tensor, start: int, steps: int) -> list[float]:
    """Seconds per greedy step: each step feeds the previous token [B] at position `start` + i."""
    seconds = []
    position = torch.full_like(token, start)
    for _ in range(steps):
        begin = time.perf_counter()
        token = decode_step(model, cache, token, position).argmax(-1)
        sync(token.device)
        seconds.append(time.perf_counter() - begin)
        position += 1
    return seconds


def bench_config(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    name: str,
    *,
    budget: Budget,
    gen_len: int,
    repeats: int,
    warmup: int,
    prefill_chunk: int | None = None,
) -> Row:
    """One sweep row: medians over `repeats` timed runs (after `warmup` untimed ones) of one configuration."""
    batch, prompt_len = input_ids.shape
    policy = policy_for(name, budget, prompt_len)
    memory = PeakMemory(input_ids.device)
    prefills, step_runs, peaks = [], [], []
    for run in range(warmup + repeats):
        memory.start()
        cache = new_cache(model, name, policy, max_len=prompt_len + gen_len, prefill_chunk=prefill_chunk)
        token, prefill_s = prefill(model, cache, input_ids)
        steps = decode_steps(model, cache, token, prompt_len, gen_len)
        if run >= warmup:
            prefills.append(prefill_s)
            step_runs.append(steps)
            peaks.append(memory.stop())
        sizes, (kept, seen) = kv_bytes(cache), kept_and_seen(cache, prompt_len + gen_len)
        del cache
    step_s = [statistics.median(column) for column in zip(*step_runs)]
    prefill_s, decode_s = statistics.median(prefills), statistics.median(map(sum, step_runs))
    peak, peak_delta = max(peaks, key=lambda p: p[1])
    bounded = policy is not None and not isinstance(policy, Full)
    return dict(
        section="sweep", policy=name, policy_desc=describe(name, policy),
        budget=budget if bounded else None, budget_tokens=policy_tokens(policy, prompt_len) if bounded else None,
        prompt_len=prompt_len, gen_len=gen_len, batch=batch, threads=torch.get_num_threads(),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."), repeats=repeats,
        prefill_chunk=prefill_chunk, prefill_s=prefill_s, prefill_tok_s=batch * prompt_len / prefill_s,
        decode_s=decode_s, decode_tok_s=batch * gen_len / decode_s,
        step_ms=[1000 * s for s in step_s], step_ms_first=1000 * step_s[0], step_ms_last=1000 * step_s[-1],
        kv_bytes=sizes[0], cache_bytes=sizes[1], seen_tokens=seen, kept_tokens=kept,
        peak_mem_bytes=peak, peak_mem_delta_bytes=peak_delta, mem_kind=memory.kind,
    )  # fmt: skip


def policy_tokens(policy, prompt_len: int) -> int:
    """Tokens a policy keeps per (sequence, KV head) at `prompt_len`, as the cache will size it."""
    return int(policy.capacity(torch.tensor([prompt_len]))[0])


def warm_up(
    model: torch.nn.Module, input_ids: torch.Tensor, policies: list[str] | tuple[str, ...], budget: Budget
) -> None:
    """One short untimed run per policy, so the first configuration does not pay one-off costs."""
    prompt_len = input_ids.shape[1]
    for name in policies:
        cache = new_cache(model, name, policy_for(name, budget, prompt_len), max_len=prompt_len + 2)
        decode_steps(model, cache, prefill(model, cache, input_ids)[0], prompt_len, 2)


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second this device reads a large float tensor with (the best of `repeats` sums)."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        data.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best

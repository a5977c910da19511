"""The timed loop: one prefill call, then one decode step per generated token (greedy), per configuration.

Every cache runs the same loop through `h2o_kv.runtime.generation` (prefill, decode_step), so the only
difference between rows is the cache and its attention path.
"""

from __future__ import annotations

import statistics
import time

import torch

from h2o_kv.policies import Budget, Full
from h2o_kv.runtime.generation import decode_step
from h2o_kv.runtime.generation import prefill as model_prefill
from h2o_kv.studies.bench.config import Cache, Row, describe, new_cache, policy_for, use_path
from h2o_kv.studies.bench.memory import PeakMemory, kept_and_seen, kv_bytes


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
    return decode_in_turn(model, {"": [cache, token]}, start, steps)[""]


def decode_in_turn(
    model: torch.nn.Module, live: dict[str, list], start: int, steps: int, read: Reads | None = None
) -> dict[str, list[float]]:
    """Greedy steps of several caches in turn, one step each, so that a machine speeding up or slowing
    down hits them alike: `live` maps a bench name to [cache, previous token [B]] (updated); returns each
    name's seconds per step. The attention path is switched between names outside the timed region.
    `read` (the bandwidth floor's reads) takes its turn after each round of steps."""
    seconds: dict[str, list[float]] = {name: [] for name in live}  # one cache: on the path the model is on
    for step in range(steps):
        for name, state in live.items():
            if len(live) > 1:
                use_path(model, name)
            position = torch.full_like(state[1], start + step)  # batches may differ between names
            begin = time.perf_counter()
            state[1] = decode_step(model, state[0], state[1], position).argmax(-1)
            sync(state[1].device)
            seconds[name].append(time.perf_counter() - begin)
        if read is not None:
            read()
    return seconds


def bench_config(model: torch.nn.Module, input_ids: torch.Tensor, name: str, **run) -> Row:
    """One sweep row: one configuration on its own (`bench_together`'s arguments)."""
    return bench_together(model, input_ids, [name], **run)[0]


def bench_together(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    names: list[str],
    *,
    budget: Budget,
    gen_len: int,
    repeats: int,
    warmup: int,
    prefill_chunk: int | None = None,
    read: Reads | None = None,
) -> list[Row]:
    """One sweep row per name: medians over `repeats` timed runs (after `warmup` untimed ones); `read` takes
    its turn after each round of the timed runs' decode steps.

    With several names a run prefills every cache, then decodes them in turn (`decode_in_turn`): the
    step-time ratios between them are then immune to the machine's drift, and all caches are held at
    once. A row's peak memory covers its whole run when it is alone, its cache and prefill when interleaved.
    """
    batch, prompt_len = input_ids.shape
    policies = {name: policy_for(name, budget, prompt_len) for name in names}
    memory = PeakMemory(input_ids.device)
    record = {name: dict(prefill_s=[], step_s=[], peaks=[]) for name in names}  # per name, over the timed runs
    for run in range(warmup + repeats):
        live, peak = {}, {}
        for name in names:
            memory.start()
            cache = new_cache(model, name, policies[name], max_len=prompt_len + gen_len, prefill_chunk=prefill_chunk)
            token, seconds = prefill(model, cache, input_ids)
            live[name] = [cache, token]
            peak[name] = memory.stop() if len(names) > 1 else None
            if run >= warmup:
                record[name]["prefill_s"].append(seconds)
        steps = decode_in_turn(model, live, prompt_len, gen_len, read if run >= warmup else None)
        for name, (cache, _) in live.items():
            record[name]["sizes"] = kv_bytes(cache), kept_and_seen(cache, prompt_len + gen_len)
            if run >= warmup:
                record[name]["step_s"].append(steps[name])
                record[name]["peaks"].append(peak[name] or memory.stop())
        del live, cache
    together = len(names) > 1
    settings = dict(budget=budget, gen_len=gen_len, repeats=repeats, prefill_chunk=prefill_chunk,
                    interleaved=together, mem_kind=memory.kind + ("-prefill" if together else ""))  # fmt: skip
    return [_row(model, input_ids, name, policies[name], record[name], **settings) for name in names]


def _row(model: torch.nn.Module, input_ids: torch.Tensor, name: str, policy, record: dict, *, budget: Budget,
         gen_len: int, repeats: int, prefill_chunk: int | None, interleaved: bool, mem_kind: str) -> Row:  # fmt: skip
    """A sweep row from what `bench_together` saw of one name: medians over its timed runs."""
    batch, prompt_len = input_ids.shape
    step_s = [statistics.median(column) for column in zip(*record["step_s"])]
    prefill_s, decode_s = statistics.median(record["prefill_s"]), statistics.median(map(sum, record["step_s"]))
    peak, peak_delta = max(record["peaks"], key=lambda p: p[1])
    (kv, cache_bytes), (kept, seen_tokens) = record["sizes"]
    bounded = policy is not None and not isinstance(policy, Full)
    return dict(
        section="sweep", policy=name, policy_desc=describe(name, policy),
        budget=budget if bounded else None, budget_tokens=policy_tokens(policy, prompt_len) if bounded else None,
        prompt_len=prompt_len, gen_len=gen_len, batch=batch, threads=torch.get_num_threads(),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."), repeats=repeats,
        prefill_chunk=prefill_chunk, prefill_s=prefill_s, prefill_tok_s=batch * prompt_len / prefill_s,
        decode_s=decode_s, decode_tok_s=batch * gen_len / decode_s, interleaved=interleaved,
        step_ms=[1000 * s for s in step_s], step_ms_first=1000 * step_s[0], step_ms_last=1000 * step_s[-1],
        kv_bytes=kv, cache_bytes=cache_bytes, seen_tokens=seen_tokens, kept_tokens=kept,
        peak_mem_bytes=peak, peak_mem_delta_bytes=peak_delta, mem_kind=mem_kind,
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


class Reads:
    """The rate at which this device reads a large float tensor (the bandwidth floor's bytes per second), timed in
    turn with the decode steps it is compared with: one sum of `nbytes` per call, on `threads` torch threads.

    The VM this project benchmarks on reads 17-29 GB/s from one half hour to the next, and a step and a read a
    minute apart see different machines; a read after every round of steps sees the same one, and its median
    is the same statistic as the steps'. The tensor is random: a tensor of ones is the same page over and over,
    which a VM's host may merge into one physical page (kernel same-page merging), and then its sum reads the
    core's cache (56-65 GB/s in two runs on the 2-core VM, against 27-35 for distinct pages)."""

    def __init__(self, device: torch.device, threads: int, nbytes: int = 1 << 29) -> None:
        self.data = torch.rand(nbytes // 4, dtype=torch.float32, device=device)
        self.threads, self.nbytes, self.seconds = threads, nbytes, []

    def __call__(self) -> None:
        count = torch.get_num_threads()
        if count != self.threads:
            torch.set_num_threads(self.threads)
        sync(self.data.device)
        start = time.perf_counter()
        self.data.sum()
        sync(self.data.device)
        self.seconds.append(time.perf_counter() - start)
        if count != self.threads:
            torch.set_num_threads(count)

    def rates(self) -> tuple[float, float]:
        """(median, best) bytes per second over the reads since the last call; starts the next count."""
        median, best = statistics.median(self.seconds), min(self.seconds)
        self.seconds = []
        return self.nbytes / median, self.nbytes / best

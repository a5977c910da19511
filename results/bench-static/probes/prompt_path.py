"""Prefill with and without the prompt path (`kernel.attend_prompt`: SDPA for the output, `attend` only
for the queries that score), alternated A/B/A/B in one process, against StaticCache + SDPA's prefill.
Bundled SmolLM2-135M, float32, the machine's default threads, 20 %; prompts of L tokens x batch B, in one
call and in chunks of 256 (`KVCache(prefill_chunk=256)`: later chunks attend over the kept tokens before
them). "blocked" routes the prompt path's work back to `attend`'s general loop (every query's
probabilities), which is what every prompt took before.

    python results/bench-static/probes/prompt_path.py 4096 1
"""
import statistics
import sys
from unittest import mock

import torch

from h2o_kv import kernel
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.bench.sweep import load_text, prompt_ids
from h2o_kv.bench.timing import prefill
from h2o_kv.models import load_model

L, B, REPEATS = int(sys.argv[1]), int(sys.argv[2]), 2
model, tok = load_model("smollm2-135m")
ids = prompt_ids(tok(load_text(), add_special_tokens=False)["input_ids"], L, B)


def blocked(q, keys, values, pos, qpos, *, scaling, new_from, window, want_scores, want_last, score_from):
    return kernel.attend(q, keys, values, pos, qpos, scaling=scaling, window=window, want_scores=want_scores,
                         want_last=want_last, score_from=score_from)  # fmt: skip


def seconds(name: str, chunk: int | None, path: str) -> float:
    cache = new_cache(model, name, policy_for(name, 0.2, L), max_len=L + 8, prefill_chunk=chunk)
    route = {"wraps": kernel.attend_prompt} if path == "prompt" else {"side_effect": blocked}
    with torch.inference_mode(), mock.patch.object(kernel, "attend_prompt", **route):
        return prefill(model, cache, ids)[1]


print(f"prefill seconds, {L} tokens x batch {B}, {torch.get_num_threads()} threads, medians of {REPEATS}")
for chunk in (None, 256):
    times: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for name, path in (("static-sdpa", "-"), ("snapkv", "prompt"), ("snapkv", "blocked"), ("h2o", "-"),
                           ("streamingllm", "prompt"), ("streamingllm", "blocked")):  # fmt: skip
            if chunk and name == "static-sdpa":
                continue
            times.setdefault(f"{name} {path}", []).append(seconds(name, chunk, path))
    print(f"\n{'one call' if chunk is None else f'chunks of {chunk}'}:")
    static = statistics.median(times["static-sdpa -"]) if "static-sdpa -" in times else None
    for label, values in times.items():
        median = statistics.median(values)
        versus = f"  {median / static:.2f}x StaticCache" if static else ""
        print(f"  {label:22s} {median:7.2f} s  ({', '.join(f'{v:.2f}' for v in values)}){versus}")

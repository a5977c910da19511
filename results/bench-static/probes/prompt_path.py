"""Prefill through the prompt path (`kernel.attend_prompt`: SDPA for the output, `attend` only for the
queries that score) against H2O's, which scores every query and so keeps `attend`'s blocked loop (the
path every prompt took before), and against StaticCache + SDPA. Alternated, medians of 2, one process.
Bundled SmolLM2-135M, float32, the machine's default threads, 20 %; prompts of L tokens x batch B, in one
call and in chunks of 256 (`KVCache(prefill_chunk=256)`: later chunks attend over the kept tokens before
them).

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


def seconds(name: str, chunk: int | None) -> tuple[float, int]:
    """Prefill seconds, and how many layer calls took the prompt path."""
    cache = new_cache(model, name, policy_for(name, 0.2, L), max_len=L + 8, prefill_chunk=chunk)
    with torch.inference_mode(), mock.patch.object(kernel, "attend_prompt", wraps=kernel.attend_prompt) as path:
        return prefill(model, cache, ids)[1], path.call_count


print(f"prefill seconds, {L} tokens x batch {B}, {torch.get_num_threads()} threads, medians of {REPEATS}")
for chunk in (None, 256):
    times: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for name in ("static-sdpa", "snapkv", "h2o", "streamingllm"):
            if chunk and name == "static-sdpa":
                continue
            took, calls = seconds(name, chunk)
            times.setdefault(f"{name} ({calls} prompt-path calls)", []).append(took)
    print(f"\n{'one call' if chunk is None else f'chunks of {chunk}'}:")
    static = next((statistics.median(v) for k, v in times.items() if k.startswith("static")), None)
    for label, values in times.items():
        median = statistics.median(values)
        versus = f"  {median / static:.2f}x StaticCache" if static else ""
        print(f"  {label:40s} {median:7.2f} s  ({', '.join(f'{v:.2f}' for v in values)}){versus}")

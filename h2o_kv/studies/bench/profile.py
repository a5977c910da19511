"""torch.profiler tables of an H2O prefill and decode step (`h2o-kv bench --profile`)."""

from __future__ import annotations

from pathlib import Path

import torch

from h2o_kv.policies import Budget
from h2o_kv.studies.bench.config import new_cache, policy_for
from h2o_kv.studies.bench.sweep import prompt_ids
from h2o_kv.studies.bench.timing import decode_steps, prefill


def profile_h2o(
    model: torch.nn.Module, token_ids: list[int], *, prompt_len: int, batch: int, budget: Budget, out_dir: Path
) -> dict[str, Path]:
    """Op tables of an H2O prefill (batch 1) and of one decode step at `batch` (cache replicated from
    batch 1), both at `prompt_len`: which kernels the time goes to. For the Python lines behind
    them, sample the same run with py-spy (`--format raw`)."""
    from torch.profiler import profile

    device = next(model.parameters()).device
    cache = new_cache(model, "h2o", policy_for("h2o", budget, prompt_len), max_len=prompt_len + 3)
    with torch.inference_mode():
        with profile() as prefill_prof:
            token, _ = prefill(model, cache, prompt_ids(token_ids, prompt_len, 1).to(device))
        cache.batch_repeat_interleave(batch)
        token = token.repeat_interleave(batch, dim=0)
        decode_steps(model, cache, token, prompt_len, 2)
        with profile() as decode_prof:
            decode_steps(model, cache, token, prompt_len + 2, 1)
    paths = {}
    for name, prof in (("prefill", prefill_prof), ("decode", decode_prof)):
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        paths[f"profile_{name}"] = out_dir / f"profile_{name}.txt"
        paths[f"profile_{name}"].write_text(table)
    return paths

"""Tensor parallel across processes: h2o-kv under ``torchrun`` with transformers' ``tp_plan="auto"``.

Eviction is decided per (sequence, KV head), and transformers' tensor-parallel plan splits the
attention projections by heads: each process computes the attention of its own query and KV heads,
so its ``KVCache`` holds only those KV heads. The cache is sharded with no extra work, every process
keeps exactly the tokens the single-process run keeps for its heads, and each holds 1/N of the KV
bytes. transformers starts the process group itself (gloo on CPU, NCCL on GPUs) from the variables
``torchrun`` sets.

    torchrun --nproc-per-node 2 -m h2o_kv.cli generate "..." --model DIR    # the CLI does this by itself

    # a script run by torchrun:
    model, tokenizer = h2o_kv.load_model(DIR, tp_plan="auto")   # each process: its share of the weights
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=64, recent=64))      # each process: its share of the KV heads

Every process must see the same inputs; ``shared_seed()`` gives sampling the same random stream on
every process, and ``is_main()`` picks the one process that prints.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from h2o_kv.model_config import text_config


def world_size() -> int:
    """Processes in this run: ``WORLD_SIZE`` as set by torchrun, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank: ``RANK`` as set by torchrun, else 0."""
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """True on the process that prints (rank 0), and in a single-process run."""
    return rank() == 0


def default_tp_plan() -> str | None:
    """``"auto"`` when started by torchrun with more than one process, else None (one process, no TP)."""
    return "auto" if world_size() > 1 else None


def check_tp(model_or_config: Any, processes: int | None = None, tp_plan: str | dict | None = "auto") -> None:
    """Raise ValueError unless the model can be split by heads over ``processes`` (default: WORLD_SIZE).

    Tensor parallelism gives each process whole heads, so the attention heads and the KV heads must
    both divide by the number of processes; with ``tp_plan="auto"`` the model must also have a
    tensor-parallel plan in transformers. Takes a model or just its config (check before loading).
    """
    processes = world_size() if processes is None else processes
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    config = text_config(getattr(model_or_config, "config", model_or_config))
    name = type(config).__name__
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(f"{name} does not say how many attention heads it has (num_attention_heads)")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % processes or kv_heads % processes:
        fits = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ValueError(
            f"tensor parallel over {processes} processes needs the attention heads ({heads}) and the KV heads "
            f"({kv_heads}) of {name} to divide by {processes}: run with --nproc-per-node in {fits}, "
            "or split layers instead (device_map='auto')"
        )
    if processes > 1 and tp_plan == "auto" and not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"{name} has no tensor-parallel plan in transformers (base_model_tp_plan), so tp_plan='auto' "
            "cannot split it: pass a tp_plan dict, or split layers instead (device_map='auto')"
        )


def tp_load_kwargs(source: str, tp_plan: str | dict) -> dict[str, Any]:
    """``from_pretrained`` arguments for tensor parallel loading, after checking the config's heads.

    Only the config is read here, so a model that cannot be split is refused before any weight is
    loaded or any process group is started. Processes other than rank 0 stop showing transformers'
    progress bars and warnings, so a run prints each once.
    """
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging

    if not (tp_plan == "auto" or isinstance(tp_plan, dict)):
        raise ValueError(f"tp_plan must be 'auto' or a dict of transformers tensor-parallel rules, got {tp_plan!r}")
    check_tp(AutoConfig.from_pretrained(source), world_size(), tp_plan)
    if not is_main():
        logging.disable_progress_bar()
        logging.set_verbosity_error()
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def shared_seed(seed: int | None = None) -> int:
    """Seed torch's RNG with the same value on every process (rank 0's choice) and return it.

    Sampling under tensor parallelism must draw the same token on every process, or the processes'
    inputs (and then their collective calls) diverge. In a single process it just seeds torch.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    if world_size() > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [seed]
        torch.distributed.broadcast_object_list(box, src=0)
        seed = int(box[0])
    torch.manual_seed(seed)
    return seed

"""Throughput and memory benchmark (`h2o-kv bench`): the stock model against h2o-kv's bounded caches.

Every policy runs the same greedy loop (`h2o_kv.runtime.generation`: one prefill call, then one decode step
per generated token) on the same real-text prompts, so the only difference is the cache and its
attention path. Per configuration (policy, prompt length, batch, thread count) it records prefill
time, decode throughput, the time of every step as the context grows, the cache's bytes measured
from its tensors and the run's peak memory, with every ratio against both stock baselines
(`DynamicCache` and `StaticCache`, SDPA attention). A second section asks the paper's "same memory,
bigger batch" question.

Files: config (names, presets, caches), memory, timing (the loop), sweep (the whole run, ratios,
roofline, same memory), bars, output and plots, profile, cli. Importing this package needs only
the core's dependencies; running it needs the `bench` extra (matplotlib, tqdm).
"""

from h2o_kv.lazy import exports
from h2o_kv.studies.bench.config import DYNAMIC  # light: names and presets (torch imports where a cache is made)

#: each exported name and the module of this package it lives in, imported on first use (the CLI's flag parsing
#: needs only `cli` and `config`, which import torch when they run)
_EXPORTS = {
    **dict.fromkeys(("check_bars", "format_bars", "summary_table"), "bars"),
    **dict.fromkeys(("add_arguments", "add_parser", "main"), "cli"),
    **dict.fromkeys(("BASELINES", "DYNAMIC", "POLICIES", "SIZES", "STATIC", "new_cache", "policy_for"), "config"),
    **dict.fromkeys(("PeakMemory", "kept_and_seen", "kv_bytes"), "memory"),
    **dict.fromkeys(("SAME_MEMORY_COLUMNS", "STEP_COLUMNS", "SWEEP_COLUMNS", "write_results"), "output"),
    **dict.fromkeys(("add_ratios", "add_roofline", "load_text", "prompt_ids", "run_bench"), "sweep"),
    **dict.fromkeys(("bench_config", "bench_together", "decode_in_turn", "decode_steps", "prefill"), "timing"),
}
_EXPORTS = {name: f"h2o_kv.studies.bench.{module}" for name, module in _EXPORTS.items()}
BASELINE = DYNAMIC  # the stock baseline's name, "full-sdpa"

__all__ = ["BASELINE", *_EXPORTS]

__getattr__ = exports(__name__, _EXPORTS)

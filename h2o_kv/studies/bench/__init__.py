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

from h2o_kv.studies.bench.bars import check_bars, format_bars, summary_table
from h2o_kv.studies.bench.cli import add_arguments, add_parser, main
from h2o_kv.studies.bench.config import BASELINES, DYNAMIC, POLICIES, SIZES, STATIC, new_cache, policy_for
from h2o_kv.studies.bench.memory import PeakMemory, kept_and_seen, kv_bytes
from h2o_kv.studies.bench.output import SAME_MEMORY_COLUMNS, STEP_COLUMNS, SWEEP_COLUMNS, write_results
from h2o_kv.studies.bench.sweep import add_ratios, add_roofline, load_text, prompt_ids, run_bench
from h2o_kv.studies.bench.timing import bench_config, bench_together, decode_in_turn, decode_steps, prefill

BASELINE = DYNAMIC  # the stock baseline's name, "full-sdpa"

__all__ = [
    "BASELINE", "BASELINES", "DYNAMIC", "POLICIES", "SIZES", "STATIC", "SAME_MEMORY_COLUMNS", "STEP_COLUMNS",
    "SWEEP_COLUMNS", "PeakMemory", "add_arguments", "add_parser", "add_ratios", "add_roofline", "bench_config",
    "bench_together", "check_bars", "decode_in_turn", "decode_steps", "format_bars", "kept_and_seen", "kv_bytes",
    "load_text", "main", "new_cache", "policy_for", "prefill", "prompt_ids", "run_bench", "summary_table",
    "write_results",
]  # fmt: skip

"""The bench's soak mode on a tiny random Llama: its accounting, and that a bounded cache's nbytes is flat
(the 10,000-step run on the bundled model is in results/soak, not CI)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import torch

from h2o_kv.studies import bench
from h2o_kv.studies.bench import soak as soak_mod

from conftest import make_model, random_ids

PROMPT, STEPS, EVERY, WARMUP = 60, 300, 25, 100


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model("llama")


@pytest.fixture(scope="module")
def result(model) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return soak_mod.soak(model, random_ids(1, PROMPT), budget=0.2, steps=STEPS, every=EVERY, warmup=WARMUP)
    finally:
        torch.set_num_threads(threads)


def expected_nbytes(model: torch.nn.Module, capacity: int, batch: int = 1) -> int:
    """Keys + values (float32) and the H2O bookkeeping (int64 position, float32 score) of capacity + 1
    slots (the incoming token's slot of "drop" storage) per (layer, sequence, KV head)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_slot = head_dim * 2 * 4 + 8 + 4
    return cfg.num_hidden_layers * batch * cfg.num_key_value_heads * (capacity + 1) * per_slot


def test_samples_count_the_steps(result):
    samples = result["samples"]
    assert [s["step"] for s in samples] == list(range(0, STEPS + 1, EVERY))
    assert [s["seen_tokens"] for s in samples] == [PROMPT + s["step"] for s in samples]
    assert samples[0]["step_ms"] is None and all(s["step_ms"] > 0 for s in samples[1:])
    assert all(s["rss_bytes"] > 0 for s in samples)  # Linux: VmRSS is read
    elapsed = [s["elapsed_s"] for s in samples]
    assert elapsed == sorted(elapsed)


def test_bounded_cache_bytes_are_flat_and_match_the_tensors(model, result):
    config, summary, samples = result["config"], result["summary"], result["samples"]
    capacity = int(0.2 * PROMPT)
    assert config["budget_tokens"] == summary["capacity_tokens"] == capacity
    assert all(s["kept_tokens"] == capacity for s in samples)
    assert {s["nbytes"] for s in samples} == {expected_nbytes(model, capacity)}
    assert summary["full_at_step"] == 0 and summary["nbytes_flat"]
    assert summary["nbytes_first"] == summary["nbytes_last"] == summary["nbytes_max"]


def test_rss_summary_is_read_from_the_samples(result):
    summary, samples = result["summary"], result["samples"]
    settled = [s["rss_bytes"] for s in samples if s["step"] >= WARMUP]
    assert summary["warmup_step"] == WARMUP and summary["rss_at_warmup"] == settled[0]
    assert summary["rss_growth_after_warmup"] == max(settled) - settled[0]
    assert summary["rss_last_minus_warmup"] == settled[-1] - settled[0]
    assert summary["rss_max"] == max(s["rss_bytes"] for s in samples)
    assert summary["rss_tolerance_bytes"] == max(soak_mod.RSS_TOLERANCE_BYTES, int(0.02 * settled[0]))
    assert summary["rss_flat"] and summary["passed"]  # 300 steps of a bounded cache leak nothing


def test_a_cache_that_grows_fails(model):
    """A budget larger than the prompt: nbytes grows until the cache is full, flat only from then;
    an unbounded cache (full-kv) is never full, so the soak fails."""
    grows = soak_mod.soak(model, random_ids(1, 40), budget=60, steps=60, every=10, warmup=10)
    nbytes = [s["nbytes"] for s in grows["samples"]]
    assert nbytes[0] < nbytes[-1] and grows["summary"]["full_at_step"] == 30  # 40 + 30 > 60: evicting
    assert grows["summary"]["nbytes_flat"] and len(set(nbytes[3:])) == 1
    unbounded = soak_mod.soak(model, random_ids(1, 40), policy="full-kv", steps=20, every=10, warmup=0)
    assert unbounded["summary"]["full_at_step"] is None and not unbounded["summary"]["passed"]


def test_summary_fails_on_rss_growth():
    samples = [dict(step=i * 10, seen_tokens=50 + i * 10, kept_tokens=8, nbytes=100, rss_bytes=(500 + 10 * i) << 20,
                    step_ms=1.0) for i in range(11)]  # fmt: skip
    summary = soak_mod.summarize(samples, capacity=8, warmup=20)
    assert summary["nbytes_flat"] and not summary["rss_flat"] and not summary["passed"]
    assert summary["rss_growth_after_warmup"] == 80 << 20
    assert summary["rss_slope_bytes_per_1k_steps"] == pytest.approx(1000 << 20)


@pytest.mark.parametrize(
    "kwargs, word",
    [(dict(steps=0), "steps"), (dict(steps=10, every=11), "every"), (dict(steps=10, every=5, warmup=10), "warmup"),
     (dict(steps=10, every=5, policy="full-sdpa"), "h2o-kv policy")],
)  # fmt: skip
def test_bad_soak_arguments_raise(model, kwargs, word):
    with pytest.raises(ValueError, match=word):
        soak_mod.soak(model, random_ids(1, 20), **kwargs)


def test_files_and_cli_flags(result, tmp_path):
    paths = soak_mod.write_soak(result, tmp_path, command="h2o-kv bench --soak 300")
    data = json.loads(paths["json"].read_text())
    assert data["command"] == "h2o-kv bench --soak 300" and data["summary"] == result["summary"]
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [s["step"] for s in result["samples"]]
    assert paths["plot"].stat().st_size > 0
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--soak", "10000", "--soak-every", "50", "--prompt-lens", "512"])
    assert (args.soak, args.soak_every, args.soak_warmup, args.out) == (10000, 50, None, None)
    assert parser.parse_args(["bench"]).soak is None

"""The benchmark's accounting on a tiny random Llama (no timing asserts: timings belong to the machine)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import torch

from h2o_kv import bench

from conftest import VOCAB, make_model

PROMPT_LENS, BATCHES, GEN, BUDGET = [40, 80], [1, 2], 4, 0.2


class CharTokenizer:
    """Stands in for a real tokenizer: one id per character."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


@pytest.fixture(scope="module")
def run() -> tuple[torch.nn.Module, list[dict]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a busy CPU: one thread is steadier
    try:
        model = make_model("llama")
        text = "To be, or not to be, that is the question. " * 20
        rows = bench.run_bench(
            model,
            CharTokenizer(),
            budget=BUDGET,
            prompt_lens=PROMPT_LENS,
            gen_len=GEN,
            batch_sizes=BATCHES,
            repeats=1,
            warmup=0,
            progress=False,
            text=text,
        )
    finally:
        torch.set_num_threads(threads)
    return model, rows


def sweep(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["section"] == "sweep"]


def kv_slot_bytes(model: torch.nn.Module) -> int:
    """Bytes of keys + values for one token of one sequence, over all layers (float32)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 4


def test_a_row_for_every_policy_and_size(run):
    _, rows = run
    got = {(r["policy"], r["prompt_len"], r["batch"]) for r in sweep(rows)}
    assert got == {(p, n, b) for p in bench.POLICIES for n in PROMPT_LENS for b in BATCHES}
    assert all(len(r["step_ms"]) == GEN for r in sweep(rows))


def test_kv_bytes_match_the_cache_tensors(run):
    model, rows = run
    cfg = model.config
    per_token = kv_slot_bytes(model)
    for r in sweep(rows):
        if r["policy"] == bench.BASELINE:  # DynamicCache: every token seen
            assert r["kv_bytes"] == r["cache_bytes"] == r["batch"] * (r["prompt_len"] + GEN) * per_token
            continue
        slots = r["budget_tokens"] + 1  # "drop" storage: capacity plus the incoming token's slot
        assert r["kv_bytes"] == r["batch"] * slots * per_token
        bookkeeping = 8 + 4 + (4 if r["policy"] == "tova" else 0)  # pos int64, score (+ last) float32
        extra = cfg.num_hidden_layers * r["batch"] * cfg.num_key_value_heads * slots * bookkeeping
        assert r["cache_bytes"] == r["kv_bytes"] + extra


def test_kv_bytes_helper_sums_the_layers_tensors():
    model = make_model("llama")
    ids = torch.randint(3, VOCAB, (2, 30))
    for policy in (None, bench.make_policy("h2o", 6)):
        cache = bench.new_cache(model, policy)
        with torch.inference_mode():
            bench.decode_steps(model, bench.prefill(model, ids, cache)[0], cache, 3)
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        assert bench.kv_bytes(cache)[0] == sum(t.numel() * t.element_size() for t in tensors)


def test_kv_ratio_is_the_budget_share(run):
    _, rows = run
    for r in sweep(rows):
        if r["policy"] == bench.BASELINE:
            assert r["kv_bytes_ratio"] == 1.0
            continue
        assert r["kv_bytes_ratio"] == pytest.approx((r["budget_tokens"] + 1) / (r["prompt_len"] + GEN))
        assert r["kv_bytes_ratio"] == pytest.approx(BUDGET, rel=0.1)


def test_token_counts(run):
    _, rows = run
    for r in sweep(rows):
        assert r["seen_tokens"] == r["prompt_len"] + GEN
        if r["policy"] == bench.BASELINE:
            assert r["kept_tokens"] == r["seen_tokens"]
        else:
            assert r["budget_tokens"] == int(BUDGET * r["prompt_len"])
            assert r["kept_tokens"] <= r["budget_tokens"]


def test_same_memory_batch_fits_the_cap(run):
    _, rows = run
    same = {r["policy"]: r for r in rows if r["section"] == "same_memory"}
    assert set(same) == {bench.BASELINE, "h2o"}
    assert same[bench.BASELINE]["batch"] == max(BATCHES)  # the cap is Full's KV at the largest batch
    assert same["h2o"]["batch"] > same[bench.BASELINE]["batch"]
    for r in same.values():
        assert r["kv_bytes"] <= r["cap_bytes"]
        assert r["kv_bytes"] == r["batch"] * r["kv_bytes_per_seq"]


def test_bars_are_reported(run):
    _, rows = run
    bars = bench.check_bars(rows)
    assert len(bars) == 4 and all(b["passed"] is not None for b in bars)
    assert bars[-1]["passed"]  # the KV accounting bar holds on any machine
    assert "bars: 4096 x 4" in bars[0]["detail"]


def test_write_results(run, tmp_path):
    _, rows = run
    paths = bench.write_results(rows, tmp_path)
    for name in ("plot_decode", "plot_steps", "plot_kv", "plot_same_memory"):
        assert paths[name].suffix == ".png" and paths[name].stat().st_size > 0
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == bench.SWEEP_COLUMNS and len(table) == len(sweep(rows))
    with paths["steps_csv"].open() as f:
        assert len(list(csv.DictReader(f))) == len(sweep(rows)) * GEN
    with paths["same_memory_csv"].open() as f:
        assert list(list(csv.DictReader(f))[0]) == bench.SAME_MEMORY_COLUMNS
    report = json.loads(paths["json"].read_text())
    assert len(report["sweep"]) == len(sweep(rows)) and len(report["bars"]) == 4
    assert paths["bars"].read_text().count("\n") == 4


def test_cli_flags_override_the_preset():
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    argv = ["bench", "--size", "large", "--prompt-lens", "64,128", "--policies", "h2o,local"]
    args = parser.parse_args(argv)
    assert args.func is bench.main
    assert args.prompt_lens == [64, 128] and args.policies == ["h2o", "local"] and args.gen_len is None


def test_bad_inputs_are_rejected_before_any_work(run):
    model, _ = run
    with pytest.raises(ValueError, match="unknown policy"):
        bench.run_bench(model, CharTokenizer(), policies=["nope"], prompt_lens=[40], text="x")
    with pytest.raises(ValueError, match="budget"):
        bench.run_bench(model, CharTokenizer(), budget=1.5, prompt_lens=[40], text="x")


def test_chunked_prefill_keeps_the_same_accounting(run):
    model, rows = run
    [chunked] = bench.run_bench(
        model, CharTokenizer(), policies=["h2o"], prompt_lens=[80], gen_len=GEN, batch_sizes=[2],
        prefill_chunk=16, progress=False, text="All the world's a stage. " * 20,
    )  # fmt: skip
    [whole] = [r for r in sweep(rows) if (r["policy"], r["prompt_len"], r["batch"]) == ("h2o", 80, 2)]
    assert chunked["prefill_chunk"] == 16 and whole["prefill_chunk"] is None
    for key in ("kv_bytes", "cache_bytes", "kept_tokens", "seen_tokens"):
        assert chunked[key] == whole[key]


def test_roofline_is_weights_plus_kept_kv_over_bandwidth():
    from h2o_kv.bench import add_roofline

    rows = [dict(kv_bytes=1_000_000, step_ms_last=4.0), dict(kv_bytes=0, step_ms_last=None)]
    add_roofline(rows, weight_bytes=3_000_000, bandwidth=2e9)
    assert rows[0]["roofline_ms"] == pytest.approx(2.0)  # (3 MB + 1 MB) / 2 GB/s
    assert rows[0]["roofline_frac"] == pytest.approx(0.5)
    assert rows[1]["roofline_ms"] == pytest.approx(1.5) and rows[1]["roofline_frac"] is None

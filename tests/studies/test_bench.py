"""The benchmark's accounting on a tiny random Llama (no timing asserts: timings belong to the machine)."""

from __future__ import annotations

import statistics

import pytest
import torch

from h2o_kv.studies import bench

from bench_helpers import (
    BATCHES,
    BUDGET,
    GEN,
    PROMPT_LENS,
    READ_BYTES,
    TEXT,
    CharTokenizer,
    one_thread,
    sweep,
)
from conftest import VOCAB, make_model, random_ids

pytestmark = pytest.mark.xdist_group("bench")  # one process runs the bench once for both files (conftest)


def kv_slot_bytes(model: torch.nn.Module) -> int:
    """Bytes of keys + values for one token of one sequence, over all layers (float32)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 4


def test_a_row_for_every_policy_and_size(bench_run):
    _, rows = bench_run
    got = {(r["policy"], r["prompt_len"], r["batch"]) for r in sweep(rows)}
    assert got == {(p, n, b) for p in bench.POLICIES for n in PROMPT_LENS for b in BATCHES}
    assert all(len(r["step_ms"]) == GEN for r in sweep(rows))


def test_kv_bytes_match_the_cache_tensors(bench_run):
    model, rows = bench_run
    cfg = model.config
    per_token = kv_slot_bytes(model)
    for r in sweep(rows):
        if r["policy"] in bench.BASELINES:  # DynamicCache: every token seen; StaticCache: allocated for them
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
    for name in (bench.DYNAMIC, bench.STATIC, "h2o"):
        cache = bench.new_cache(model, name, bench.policy_for(name, 6, 30), max_len=33)
        with torch.inference_mode():
            bench.decode_steps(model, cache, bench.prefill(model, cache, ids)[0], 30, 3)
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        assert bench.kv_bytes(cache)[0] == sum(t.numel() * t.element_size() for t in tensors)


def test_kv_ratio_is_the_budget_share(bench_run):
    _, rows = bench_run
    for r in sweep(rows):
        if r["policy"] in bench.BASELINES:
            assert r["kv_bytes_ratio"] == 1.0
            continue
        assert r["kv_bytes_ratio"] == pytest.approx((r["budget_tokens"] + 1) / (r["prompt_len"] + GEN))
        assert r["kv_bytes_ratio"] == pytest.approx(BUDGET, rel=0.1)


def test_token_counts(bench_run):
    _, rows = bench_run
    for r in sweep(rows):
        assert r["seen_tokens"] == r["prompt_len"] + GEN
        if r["policy"] in bench.BASELINES:
            assert r["kept_tokens"] == r["seen_tokens"]
        else:
            assert r["budget_tokens"] == int(BUDGET * r["prompt_len"])
            assert r["kept_tokens"] <= r["budget_tokens"]


def test_same_memory_batch_fits_the_cap(bench_run):
    _, rows = bench_run
    same = {r["policy"]: r for r in rows if r["section"] == "same_memory"}
    assert set(same) == {*bench.BASELINES, "h2o"}
    for name in bench.BASELINES:  # the cap is the stock caches' KV at the largest batch
        assert same[name]["batch"] == max(BATCHES)
        assert same["h2o"]["batch"] > same[name]["batch"]
    widest = {r["policy"]: r for r in sweep(rows) if r["prompt_len"] == max(PROMPT_LENS) and r["batch"] == max(BATCHES)}
    for name in bench.BASELINES:  # the sweep measured that very run: its medians are reused, not a second run
        assert same[name]["decode_tok_s"] == widest[name]["decode_tok_s"]
    for r in same.values():
        assert r["kv_bytes"] <= r["cap_bytes"]
        assert r["kv_bytes"] == r["batch"] * r["kv_bytes_per_seq"]


def test_bad_inputs_are_rejected_before_any_work(bench_run):
    model, _ = bench_run
    with pytest.raises(ValueError, match="unknown policy"):
        bench.run_bench(model, CharTokenizer(), policies=["nope"], prompt_lens=[40], text="x")
    with pytest.raises(ValueError, match="budget"):
        bench.run_bench(model, CharTokenizer(), budget=1.5, prompt_lens=[40], text="x")
    with pytest.raises(ValueError, match="threads"):
        bench.run_bench(model, CharTokenizer(), threads=[-1], prompt_lens=[40], text="x")


def test_chunked_prefill_keeps_the_same_accounting(bench_run):
    model, rows = bench_run
    [chunked] = bench.run_bench(
        model, CharTokenizer(), policies=["h2o"], prompt_lens=[80], gen_len=GEN, batch_sizes=[2],
        prefill_chunk=16, progress=False, text="All the world's a stage. " * 20,
    )  # fmt: skip
    [whole] = [r for r in sweep(rows) if (r["policy"], r["prompt_len"], r["batch"]) == ("h2o", 80, 2)]
    assert chunked["prefill_chunk"] == 16 and whole["prefill_chunk"] is None
    for key in ("kv_bytes", "cache_bytes", "kept_tokens", "seen_tokens"):
        assert chunked[key] == whole[key]


def test_roofline_is_weights_plus_kept_kv_over_bandwidth():
    from h2o_kv.studies.bench import add_roofline

    rows = [dict(kv_bytes=1_000_000, step_ms_last=4.0), dict(kv_bytes=0, step_ms_last=None)]
    add_roofline(rows, weight_bytes=3_000_000, bandwidth=2e9)
    assert rows[0]["roofline_ms"] == pytest.approx(2.0)  # (3 MB + 1 MB) / 2 GB/s
    assert rows[0]["roofline_frac"] == pytest.approx(0.5)
    assert rows[1]["roofline_ms"] == pytest.approx(1.5) and rows[1]["roofline_frac"] is None
    assert "roofline_best_ms" not in rows[0]
    add_roofline(rows, weight_bytes=3_000_000, bandwidth=2e9, best=4e9)
    assert rows[0]["roofline_best_ms"] == pytest.approx(1.0) and rows[0]["bandwidth_best_gb_s"] == 4.0


def test_the_floor_is_read_in_turn_with_the_timed_steps():
    """One read after each round of the timed runs' decode steps (none in the warm-up run), at the reads' own
    thread count; the rates are the median and the best of them, and each count starts afresh."""
    from h2o_kv.studies.bench.timing import Reads

    model = make_model("llama")
    ids = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with one_thread():
        reads = Reads(torch.device("cpu"), threads=2, nbytes=READ_BYTES)
        seen = []
        reads.data.sum = lambda: seen.append(torch.get_num_threads())  # what each read ran at
        rows = bench.bench_together(model, ids, ["h2o", bench.STATIC], budget=6, gen_len=5, repeats=2, warmup=1,
                                    read=reads)  # fmt: skip
        assert torch.get_num_threads() == 1  # put back after each read
    assert seen == [2] * 10 and len(reads.seconds) == 10  # 2 timed runs x 5 rounds of steps
    seconds = list(reads.seconds)
    assert reads.rates() == (READ_BYTES / statistics.median(seconds), READ_BYTES / min(seconds))
    assert reads.seconds == [] and len(rows) == 2


def test_ratios_against_both_stock_baselines(bench_run):
    _, rows = bench_run
    at = {(r["policy"], r["prompt_len"], r["batch"]): r for r in sweep(rows)}
    for r in sweep(rows):
        for label, baseline in (("dynamic", bench.DYNAMIC), ("static", bench.STATIC)):
            ref = at[(baseline, r["prompt_len"], r["batch"])]
            assert r[f"decode_tok_s_vs_{label}"] == pytest.approx(r["decode_tok_s"] / ref["decode_tok_s"])
            assert r[f"prefill_s_vs_{label}"] == pytest.approx(r["prefill_s"] / ref["prefill_s"])
            assert r[f"kv_bytes_vs_{label}"] == pytest.approx(r["kv_bytes"] / ref["kv_bytes"])


def test_token_budget_threads_and_bfloat16():
    """An int budget is tokens at every prompt length; one row per thread count; bf16 halves the KV bytes."""
    model = make_model("llama").to(torch.bfloat16)
    threads = torch.get_num_threads()
    rows = bench.run_bench(
        model, CharTokenizer(), policies=["h2o", bench.STATIC], budget=6, prompt_lens=[30, 60], gen_len=3,
        batch_sizes=[1], threads=[1, 2], progress=False, text="Now is the winter of our discontent. " * 10,
    )  # fmt: skip
    assert torch.get_num_threads() == threads  # restored
    per_token = kv_slot_bytes(model) // 2  # bfloat16: 2 bytes an element
    got = {(r["policy"], r["prompt_len"], r["threads"]) for r in sweep(rows)}
    assert got == {(p, n, t) for p in ("h2o", bench.STATIC) for n in (30, 60) for t in (1, 2)}
    for r in sweep(rows):
        assert r["dtype"] == "bfloat16"
        if r["policy"] == "h2o":
            assert r["budget_tokens"] == 6 and r["kept_tokens"] == 6 and r["kv_bytes"] == 7 * per_token
        else:
            assert r["kv_bytes"] == (r["prompt_len"] + 3) * per_token and r["decode_tok_s_vs_static"] == 1.0


def test_missing_corpus_is_an_error_not_a_fallback(monkeypatch):
    import h2o_kv.studies.data

    def broken(*args, **kwargs):
        raise FileNotFoundError("corpus not prepared: run h2o-kv setup")

    monkeypatch.setattr(h2o_kv.studies.data, "load_corpus", broken)
    with pytest.raises(FileNotFoundError, match="h2o-kv setup"):
        bench.run_bench(make_model("llama"), CharTokenizer(), prompt_lens=[20], gen_len=2, batch_sizes=[1])


def test_int8_suffix_stores_int8_and_counts_its_scales():
    from h2o_kv.studies.bench.config import new_cache, policy_for
    from h2o_kv.studies.bench.memory import kv_bytes

    model = make_model("llama")
    ids = random_ids(1, 40)
    sizes = {}
    for name in ("h2o", "h2o-int8"):
        cache = new_cache(model, name, policy_for(name, 0.5, 40), max_len=44)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        sizes[name] = kv_bytes(cache)[0]
        assert (cache.settings.kv_dtype == "int8") == name.endswith("-int8")
    # int8 keys/values (1 byte) plus one float32 scale per token and head, against float32 (4 bytes)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert sizes["h2o-int8"] / sizes["h2o"] == pytest.approx((head_dim + 4) / (4 * head_dim))


def test_interleaved_steps_equal_separate_runs():
    """Decoding caches in turn (switching the attention path between them) changes nothing a cache sees."""
    model = make_model("llama")
    ids = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    names = (bench.STATIC, "h2o", bench.DYNAMIC, "tova")

    def start(name):
        cache = bench.new_cache(model, name, bench.policy_for(name, 6, 30), max_len=40)
        return [cache, bench.prefill(model, cache, ids)[0]]

    with torch.inference_mode():
        together = {name: start(name) for name in names}
        seconds = bench.decode_in_turn(model, together, 30, 6)
        for name in names:
            alone = {name: start(name)}
            bench.decode_in_turn(model, alone, 30, 6)
            assert torch.equal(together[name][1], alone[name][1]), name
            assert bench.kv_bytes(together[name][0]) == bench.kv_bytes(alone[name][0])
    assert all(len(seconds[name]) == 6 and min(seconds[name]) > 0 for name in names)


def test_interleaved_bench_has_the_same_accounting(bench_run):
    model, rows = bench_run
    with one_thread():
        together = bench.run_bench(model, CharTokenizer(), budget=BUDGET, prompt_lens=[max(PROMPT_LENS)], gen_len=GEN,
                                   batch_sizes=[max(BATCHES)], threads=[1], progress=False, interleave=True,
                                   text=TEXT, read_bytes=READ_BYTES)  # fmt: skip
    size = (max(PROMPT_LENS), max(BATCHES))
    alone = {(r["section"], r["policy"]): r for r in rows if (r["prompt_len"], r["batch"]) == size}
    same_alone = {r["policy"]: r for r in rows if r["section"] == "same_memory"}
    assert {(r["section"], r["policy"]) for r in together} == {*(("sweep", p) for p in bench.POLICIES),
                                                               *(("same_memory", p) for p in same_alone)}  # fmt: skip
    for r in together:
        ref = alone[("sweep", r["policy"])] if r["section"] == "sweep" else same_alone[r["policy"]]
        for key in ("kv_bytes", "seen_tokens", "kept_tokens", "batch"):
            assert r[key] == ref[key], (r["policy"], key)
        if r["section"] == "sweep":
            assert r["interleaved"] and r["mem_kind"].endswith("-prefill") and len(r["step_ms"]) == GEN
            assert r["cache_bytes"] == ref["cache_bytes"] and not ref["interleaved"]
        else:
            assert r["mem_kind"].endswith("-together") and r["decode_tok_s"] > 0


def test_same_memory_runs_int8_storage_at_a_bigger_batch():
    with one_thread():
        rows = bench.run_bench(make_model("llama"), CharTokenizer(), policies=["static-sdpa", "h2o", "h2o-int8"],
                               budget=BUDGET, prompt_lens=[80], gen_len=GEN, batch_sizes=[2], threads=[1],
                               progress=False, text=TEXT, read_bytes=READ_BYTES)  # fmt: skip
    same = {r["policy"]: r for r in rows if r["section"] == "same_memory"}
    assert set(same) == {"static-sdpa", "h2o", "h2o-int8"}
    assert same["static-sdpa"]["batch"] < same["h2o"]["batch"] < same["h2o-int8"]["batch"]
    for r in same.values():
        assert r["kv_bytes"] <= r["cap_bytes"] and r["kept_tokens"] <= r["seen_tokens"]
    bars = {b["bar"]: b for b in bench.check_bars(rows, defined_at=(80, 2))}
    int8_bar = bars["same memory, int8 KV: H2O's bigger batch >= 4x static-sdpa tok/s"]
    assert int8_bar["passed"] is not None and f"batch {same['h2o-int8']['batch']} vs 2" in int8_bar["detail"]

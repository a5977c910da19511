"""The cache's public API, what a serving runtime may use: fork, write_rows / free_rows, steady, row_stats."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import h2o_kv
from h2o_kv.runtime.generation import decode_step, prefill

from conftest import random_ids

POLICIES = [
    lambda: h2o_kv.H2O(heavy=6, recent=6),
    lambda: h2o_kv.SnapKV(budget=10),
    lambda: h2o_kv.TOVA(budget=10),
    lambda: h2o_kv.KeyDiff(budget=10),
    lambda: h2o_kv.AdaKV(h2o_kv.SnapKV(budget=10)),
    lambda: h2o_kv.Full(),
]


def greedy(model, cache, logits, start: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy tokens of every row from `logits` [B, V], and the last step's logits."""
    tokens, out = [], logits
    for i in range(steps):
        token = out.argmax(-1)
        tokens.append(token.tolist())
        out = decode_step(model, cache, token, torch.full_like(token, start + i))
    return tokens, out


@pytest.mark.parametrize("make", POLICIES, ids=["h2o", "snapkv", "tova", "keydiff", "adakv", "full"])
def test_a_fork_goes_on_as_the_original_would_and_shares_nothing(llama, make):
    ids = random_ids(2, 40, seed=3)
    cache = h2o_kv.KVCache(make())
    logits = prefill(llama, cache, ids)
    twin = cache.fork([1])  # the second sequence alone
    before = cache.kept_per_head().clone()
    solo = h2o_kv.KVCache(make())
    solo_logits = prefill(llama, solo, ids[1:])
    twin_tokens, twin_out = greedy(llama, twin, logits[1:], 40, 12)
    solo_tokens, solo_out = greedy(llama, solo, solo_logits, 40, 12)
    assert twin_tokens == solo_tokens
    torch.testing.assert_close(twin_out, solo_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.kept_per_head(), before)  # the original did not move
    assert twin.kept_per_head().shape[1] == 1 and twin.nbytes() < cache.nbytes()
    both_tokens, _ = greedy(llama, cache, logits, 40, 12)  # and still decodes as before
    assert [row[1] for row in both_tokens] == [row[0] for row in solo_tokens]


def test_fork_is_refused_before_the_prompt_and_for_rows_it_does_not_hold(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    with pytest.raises(ValueError, match="holds nothing yet"):
        cache.fork()
    prefill(llama, cache, random_ids(1, 20))
    with pytest.raises(ValueError, match=r"rows in \[0, 1\)"):
        cache.fork([1])


def test_rows_written_and_freed_keep_the_others_in_order(llama):
    ids = random_ids(3, 30, seed=5)
    caches = []
    for row in range(3):
        cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=5, recent=5))
        prefill(llama, cache, ids[row : row + 1])
        caches.append(cache)
    batch = caches[0]
    assert batch.write_rows(caches[1]) == range(1, 2)
    assert batch.write_rows(caches[2]) == range(2, 3)
    stats = [batch.row_stats(row) for row in range(3)]
    assert [s.seen_tokens for s in stats] == [30, 30, 30] and all(s.kept_tokens == 10 for s in stats)
    batch.free_rows([1])
    assert batch.batch_size == 2
    solo = h2o_kv.KVCache(h2o_kv.H2O(heavy=5, recent=5))
    prefill(llama, solo, ids[2:3])
    token = torch.tensor([7, 9])
    got = decode_step(llama, batch, token, torch.tensor([30, 30]))
    want = decode_step(llama, solo, token[1:], torch.tensor([30]))
    torch.testing.assert_close(got[1:], want, rtol=1e-5, atol=1e-5)


def test_steady_once_every_slot_is_full_and_the_last_step_left_one(llama):
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4), compile_kernel=False)
    assert not cache.steady
    logits = prefill(llama, cache, random_ids(1, 20))
    assert not cache.steady  # no decode step has left its vacant slot yet
    greedy(llama, cache, logits, 20, 3)
    assert cache.steady
    seen = cache.get_seq_length()
    cache.note_replayed_step()
    assert cache.get_seq_length() == seen + 1
    assert not h2o_kv.KVCache(h2o_kv.Full()).steady


def test_the_runtime_reads_no_cache_layer():
    """runtime/ uses the cache's public API only: no `.layers`, no layer's private fields."""
    runtime = pathlib.Path(h2o_kv.__file__).parent / "runtime"
    offenders = []
    for path in runtime.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("layers", "next_pos", "packed", "pending", "vacant"):
                offenders.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not offenders, offenders


def test_compress_a_document_once_and_ask_many_questions_with_generate(llama):
    """The documented pattern: the document goes through the cache once (compressed to its budget), and each
    question is generated from a fork, exactly as from a cache that was fed the document and that question alone;
    the compressed document stays as it was."""
    doc = random_ids(1, 60, seed=2)

    def compressed() -> h2o_kv.KVCache:
        cache = h2o_kv.KVCache(h2o_kv.SnapKV(budget=0.25), prompt_len=doc.shape[1])
        with torch.no_grad():
            llama(doc, past_key_values=cache, use_cache=True)
        return cache

    cache = compressed()
    kept = cache.kept_per_head().clone()
    for seed in range(3):
        ids = torch.cat([doc, random_ids(1, 8, seed=10 + seed)], 1)
        got = llama.generate(ids, past_key_values=cache.fork(), max_new_tokens=6, do_sample=False)
        want = llama.generate(ids, past_key_values=compressed(), max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want)
        assert torch.equal(cache.kept_per_head(), kept) and cache.get_seq_length() == doc.shape[1]


def test_a_fork_refuses_another_model(llama):
    from conftest import make_model

    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4))
    prefill(llama, cache, random_ids(1, 20))
    other = make_model("gemma3")
    with pytest.raises(ValueError, match="filled by another model|belongs to one model"):
        prefill(other, cache.fork(), random_ids(1, 4), start=20)

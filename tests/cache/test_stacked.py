"""`Stacked`: one decode call over several one-sequence KVCaches steps each as its own call would, and
`greedy_together` answers as `greedy_continue` row by row."""

from __future__ import annotations

import pytest
import torch

from h2o_kv import KVCache, enable
from h2o_kv.cache.stacked import Stacked
from h2o_kv.policies import build
from h2o_kv.runtime.generation import decode_step, forward, greedy_continue, greedy_together

from conftest import make_model, random_ids
from helpers import kept_positions

# policies with different layers and storage: uniform rows, a head-pooled row (AdaKV), int8, Full, a window
CONFIGS = [("h2o", 9, None), ("snapkv", 8, None), ("adakv", 8, None), ("tova", 7, None), ("h2o", 9, "int8"),
           ("full", None, None), ("streamingllm", 6, None)]  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return make_model(request.param)


def _prefilled(model, lengths: list[int], headroom: int = 0) -> tuple[list[KVCache], list[torch.Tensor]]:
    """A fresh cache per config, each fed its own prompt (of `lengths[i]` tokens): the caches and their logits."""
    caches, logits = [], []
    for i, ((policy, budget, kv_dtype), n) in enumerate(zip(CONFIGS, lengths, strict=True)):
        cache = KVCache(build(policy, budget), kv_dtype=kv_dtype, headroom=headroom)
        with torch.no_grad():
            logits.append(forward(model, cache, random_ids(1, n, seed=20 + i)))
        caches.append(cache)
    return caches, logits


def test_a_stacked_step_is_each_caches_own_step(model) -> None:
    """Rows at different positions, of different policies and storage: after three stacked steps each cache keeps
    the positions its own steps keep, and each row's logits match its own call's (to a batched product's rounding)."""
    lengths = [20, 23, 18, 25, 21, 19, 22]
    stacked, _ = _prefilled(model, lengths, headroom=1)
    alone, _ = _prefilled(model, lengths, headroom=1)
    for step in range(3):
        tokens = torch.tensor([3 + 5 * i + step for i in range(len(CONFIGS))])
        positions = torch.tensor([n + step for n in lengths])
        with torch.no_grad():
            together = decode_step(model, Stacked(stacked), tokens, positions)
            for row, cache in enumerate(alone):
                own = decode_step(model, cache, tokens[row : row + 1], positions[row : row + 1])
                torch.testing.assert_close(together[row], own[0], rtol=1e-4, atol=1e-4)
    evicted = 0
    for (policy, _, _), mine, theirs in zip(CONFIGS, stacked, alone, strict=True):
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            assert kept_positions(a) == kept_positions(b), policy
        assert mine.seen_tokens == theirs.seen_tokens
        evicted += mine.kept_tokens < mine.seen_tokens
    assert evicted >= 5  # the bounded caches did evict while stepping together


def test_greedy_together_answers_as_each_row_alone(model) -> None:
    lengths = [20, 23, 18, 25, 21, 19, 22]
    limits = [6, 1, 8, 4, 7, 8, 5]
    stops = [None, None, lambda out: len(out) == 3, None, None, None, None]
    mine, first = _prefilled(model, lengths)
    outs = greedy_together(model, mine, first, lengths, limits, eos={7}, done=stops)
    theirs, first = _prefilled(model, lengths)
    for row, cache in enumerate(theirs):
        with torch.no_grad():
            alone = greedy_continue(model, cache, first[row], lengths[row], limits[row], {7}, stops[row])
        assert outs[row] == alone, CONFIGS[row]
        for a, b in zip(mine[row].layers, cache.layers, strict=True):  # each token fed at its own position
            assert kept_positions(a) == kept_positions(b), CONFIGS[row]
    assert [len(o) for o in outs][1:3] == [1, 3]  # a limit of one token; a done() that stops at three
    assert greedy_together(model, mine[:1], first[:1], lengths[:1], 0) == [[]]


def test_stacking_what_cannot_be_stacked_is_refused(model) -> None:
    caches, _ = _prefilled(model, [20, 23, 18, 25, 21, 19, 22])
    with pytest.raises(ValueError, match="at least one"):
        Stacked([])
    with pytest.raises(TypeError, match="KVCache"):
        Stacked([caches[0], object()])
    with pytest.raises(ValueError, match="stacked twice"):
        Stacked([caches[0], caches[0]])
    with pytest.raises(ValueError, match="read its prompt"):
        Stacked([KVCache(build("h2o", 4))])
    two = KVCache(build("h2o", 9))
    with torch.no_grad():
        forward(model, two, random_ids(2, 12, seed=1))
    with pytest.raises(ValueError, match="one sequence"):
        Stacked([two])
    with pytest.raises(ValueError, match="decode step"), torch.no_grad():  # a prompt goes into each cache alone
        forward(model, Stacked(caches[:2]), random_ids(2, 3, seed=2), positions=torch.tensor([[20, 21, 22]] * 2))
    stock = make_model("llama", enable=False)
    with pytest.raises(RuntimeError, match="enable"), torch.no_grad():
        decode_step(stock, Stacked(caches[:2]), torch.tensor([1, 2]), torch.tensor([20, 23]))
    enable(stock)

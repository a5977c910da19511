"""AdaKV's head-pooled row in the steady decode step (pooled.py): its eviction in torch follows the exact order
with no host sync (`lowest_in_order`), so the step compiles whole (`fullgraph=True`, as a captured step needs) and
gives the eager logits and kept tokens."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.backends import interpreted, triton_importable
from h2o_kv.cache.pooled import lowest_in_order
from h2o_kv.runtime.generation import forward, prefill

from conftest import make_model, random_ids
from helpers import kept_positions


@pytest.mark.parametrize("seed", range(6))
def test_lowest_in_order_frees_the_first_slots_of_the_exact_order(seed):
    """Priorities drawn from a few values (many ties, across heads and at the boundary), positions shared by
    heads: the slots chosen are the first `count` by (priority, position, head), in slot order."""
    gen = torch.Generator().manual_seed(seed)
    batch, slots, heads = 3, 40, 4
    priority = torch.randint(0, 4, (batch, 1, slots), generator=gen).float()
    priority[0, 0, :5] = float("inf")  # protected slots
    pairs = torch.stack([torch.randperm(12 * heads, generator=gen)[:slots] for _ in range(batch)])[:, None]
    pos, head = pairs // heads, (pairs % heads).to(torch.int8)  # a row holds a (position, head) once
    got = lowest_in_order(priority, pos, head, heads)
    for row in range(batch):
        keys = [(float(priority[row, 0, s]), int(pos[row, 0, s]), int(head[row, 0, s]), s) for s in range(slots)]
        want = sorted(key[-1] for key in sorted(keys)[:heads])
        assert got[row, 0].tolist() == want


@pytest.mark.parametrize("triton", ["0", "1"], ids=["torch", "triton"])
def test_compiled_adakv_step_equals_eager(monkeypatch, triton):
    """torch.compile(fullgraph=True) over AdaKV's steady decode steps (after eager ones reach them; on the Triton
    kernels, the pooled row's attention is `decode_attend`): a host sync would break the graph and fail here."""
    if triton == "1" and not (triton_importable() and interpreted()):
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter")
    monkeypatch.setenv("H2O_KV_TRITON", triton)
    model, ids = make_model("llama"), random_ids(2, 12)
    policy = h2o_kv.AdaKV(h2o_kv.H2O(heavy=4, recent=4))
    caches = [h2o_kv.KVCache(policy, compile_kernel=False) for _ in range(2)]
    tokens = [prefill(model, cache, ids).argmax(-1) for cache in caches]

    def step(cache, token, position):
        return forward(model, cache, token.view(-1, 1), positions=position.view(-1, 1))

    compiled = torch.compile(step, fullgraph=True)
    position, eager_steps = torch.full((2,), 12), 3
    with torch.inference_mode():
        for i in range(eager_steps + 5):
            if i == eager_steps:
                assert caches[1].steady, "AdaKV's layers did not reach the steady step"
            fast = compiled if i >= eager_steps else step
            eager, fast = step(caches[0], tokens[0], position), fast(caches[1], tokens[1], position)
            torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
            tokens, position = [eager.argmax(-1), fast.argmax(-1)], position + 1
    for a, b in zip(caches[1].layers, caches[0].layers):
        assert [kept_positions(a, row) for row in (0, 1)] == [kept_positions(b, row) for row in (0, 1)]
    assert caches[1].steady and caches[1].kept_tokens == caches[0].kept_tokens

"""`triton_evict.decode_evict` over rows of different budgets (a served batch: each prompt's fraction budget is its
row's capacity), and int8 storage written by the kernel: the same results as the torch step (`Steady`).

On a CPU the kernels run under Triton's interpreter at tiny shapes (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
from test_triton import literal

import h2o_kv
from h2o_kv.backends import interpreted, triton_importable
from h2o_kv.cache.quant import dequantize, quantize
from h2o_kv.runtime.generation import forward, prefill

from conftest import make_model, random_ids
from helpers import kept_positions

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed (the dev extra has it)")
DEVICES = (["cpu"] if interpreted() else []) + (["cuda"] if torch.cuda.is_available() else [])
NEVER = torch.iinfo(torch.int64).max


def torch_evict(pos, score, next_pos, recent, capacity):
    """`Steady._evict_one` with H2O's priority: each row over its capacity frees the oldest of its lowest
    priorities (empty slots never), each row within it its first empty slot. Returns the victims [B, H, 1]."""
    valid = pos >= 0
    priority = torch.where(pos >= next_pos - recent, float("inf"), score)
    over = valid.sum(-1, keepdim=True) > capacity.view(-1, 1, 1)
    priority = torch.where(valid, priority, torch.where(over, float("inf"), float("-inf")))
    oldest = torch.where(priority == priority.amin(-1, keepdim=True), pos, NEVER)
    return oldest.argmin(-1, keepdim=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["float32", "int8"])
@pytest.mark.parametrize("write", [False, True], ids=["written", "fused-write"])
@pytest.mark.parametrize("recent", [3, 200])
def test_decode_evict_with_a_capacity_per_row(device, storage, write, recent):
    """Rows at different capacities: some over theirs (free a token), some at or under it (free an empty slot),
    one without any empty slot; `recent` 200 protects every token (a row over capacity then frees an empty slot,
    as the torch step does). Output, scores, positions and victims match literal attention and the torch eviction;
    with `write` the kernel stores the new token (int8: its values and scales) into the vacant slots."""
    from h2o_kv.backends.triton_evict import decode_evict

    gen = torch.Generator().manual_seed(recent + write)
    batch, heads, group, slots, dim = 3, 2, 2, 45, 16
    capacity = torch.tensor([44, 30, 20]).view(batch, 1)
    held = torch.tensor([[45, 44], [31, 30], [16, 21]])  # tokens per row once the new one is in
    q = torch.randn(batch, heads * group, 1, dim, generator=gen) * 2
    k, v = torch.randn(2, batch, heads, slots, dim, generator=gen)
    pos = torch.stack([torch.randperm(60, generator=gen)[:slots] for _ in range(batch * heads)]).view(batch, heads, -1)
    order = torch.rand(batch, heads, slots, generator=gen).argsort(-1)  # which slots hold a token: random ones
    pos = torch.where(order < held[..., None], pos, -1)
    score = torch.where(pos >= 0, torch.rand(batch, heads, slots, generator=gen), 0.0)
    next_pos = torch.tensor([61, 58, 64]).view(batch, 1, 1)
    vac = torch.where(pos >= 0, torch.rand(batch, heads, slots, generator=gen), -1.0).argmax(-1, keepdim=True)
    pos = pos.scatter(2, vac, (next_pos - 1).expand(batch, heads, 1))  # the new token's slot: score 0
    score = score.scatter(2, vac, 0.0)
    scales, k_ref, v_ref = (None, None), k, v
    if storage == "int8":
        (k, ks), (v, vs) = quantize(k), quantize(v)
        scales, k_ref, v_ref = [ks, vs], dequantize(k, ks, torch.float32), dequantize(v, vs, torch.float32)
    ref_out, summed, _ = literal(q, k_ref, v_ref, (pos >= 0)[:, :, None], dim**-0.5)
    ref_score = score.double() + summed
    victim = torch_evict(pos, ref_score, next_pos, recent, capacity)
    ref_pos, ref_score = pos.scatter(2, victim, -1), ref_score.scatter(2, victim, 0.0)

    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    stored = [t.clone() for t in (k, v, pos, *scales) if t is not None]
    new = {}
    if write:  # the vacant slots as the last eviction left them (empty); the kernel writes the token there
        take = lambda t: t.gather(2, vac.view(batch, heads, 1, *[1] * (t.dim() - 3)).expand(-1, -1, 1, *t.shape[3:]))  # noqa: E731
        new = dict(new_key=take(k), new_value=take(v), new_pos=(next_pos - 1).view(batch, 1))
        if storage == "int8":
            new.update(new_key_scale=take(scales[0]), new_value_scale=take(scales[1]))
        stored[2] = stored[2].scatter(2, vac, -1)
        for t in (stored[0], stored[1]):
            t.scatter_(2, vac[..., None].expand(-1, -1, -1, dim), 0)
        for t in stored[3:]:
            t.scatter_(2, vac, 0.0)
    k_d, v_d, pos_d, *scales_d = (to(t) for t in stored)
    scales_d = scales_d or [None, None]
    score_d, vacant = to(score.clone()), to(vac.clone())
    out = decode_evict(to(q), k_d, v_d, pos_d, score_d, vacant, to(next_pos), to(torch.tensor(recent).view(1, 1, 1)),
                       scaling=dim**-0.5, key_scale=scales_d[0], value_scale=scales_d[1], capacity=to(capacity),
                       **{name: to(t) for name, t in new.items()})  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), ref_out.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert torch.equal(vacant.cpu(), victim)
    assert torch.equal(pos_d.cpu(), ref_pos)
    torch.testing.assert_close(score_d.cpu().double(), ref_score, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_d.cpu(), k) and torch.equal(v_d.cpu(), v)  # the token written; nothing else touched
    if storage == "int8":
        assert torch.equal(scales_d[0].cpu(), scales[0]) and torch.equal(scales_d[1].cpu(), scales[1])
    freed_empty = pos.gather(2, victim) < 0
    assert bool(freed_empty.any()) and not bool(freed_empty.all())  # both kinds of row in the batch


@pytest.mark.filterwarnings("ignore:H2O.budget=0.5. keeps")
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_batch_of_different_budgets_steps_on_the_kernel(monkeypatch, kv_dtype):
    """Two prompts of different lengths with a fraction budget (capacities 6 and 10) in one batch, as the engine
    joins them: once full, every step is `decode_evict` with a capacity per row (the layers `ragged`, and `steady`:
    a captured step can replay them), and the logits and kept tokens equal the torch steps'."""
    from h2o_kv.backends import triton_evict

    if not interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter (test_cuda.py covers CUDA)")
    kernel, calls = triton_evict.decode_evict, []
    monkeypatch.setattr(triton_evict, "decode_evict", lambda *a, **kw: calls.append(kw["capacity"]) or kernel(*a, **kw))
    model = make_model("llama")
    prompts = [random_ids(1, 12, seed=1), random_ids(1, 20, seed=2)]
    runs = []
    for triton in ("0", "1"):
        monkeypatch.setenv("H2O_KV_TRITON", triton)
        caches = [h2o_kv.KVCache(h2o_kv.H2O(budget=0.5), kv_dtype=kv_dtype, compile_kernel=False) for _ in prompts]
        with torch.inference_mode():
            tokens = torch.cat([prefill(model, c, ids).argmax(-1) for c, ids in zip(caches, prompts)])
            cache, position, logits = caches[0], torch.tensor([12, 20]), []
            cache.write_rows(caches[1])
            for _ in range(5):
                logits.append(forward(model, cache, tokens.view(-1, 1), positions=position.view(-1, 1)))
                tokens, position = logits[-1].argmax(-1), position + 1
        assert cache.steady and all(layer.ragged() for layer in cache.layers)
        runs.append((torch.stack(logits), [[kept_positions(la, row) for la in cache.layers] for row in (0, 1)]))
    assert len(calls) == 2 * 4 and all(c.view(-1).tolist() == [6, 10] for c in calls)  # 2 layers, 4 steady steps
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-4, rtol=1e-4)
    assert runs[1][1] == runs[0][1]
    assert [len(head) for head in runs[1][1][0][0]] == [6, 6] and [len(h) for h in runs[1][1][1][0]] == [10, 10]

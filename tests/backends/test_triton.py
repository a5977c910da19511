"""The Triton kernels (h2o_kv/backends) against literal float64 attention, and the compiled decode step.

On a CPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1 before anything imports
Triton) at tiny shapes; on a GPU the same tests run them compiled, bfloat16 included. The compiled-step tests
check that a decode step with a KVCache traces into one graph (`fullgraph=True`: a host sync or graph break
fails them) and gives the eager logits.
"""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.backends import interpreted, triton_importable
from h2o_kv.cache.quant import dequantize, quantize
from h2o_kv.cache.routes import Call, Slots, attend
from h2o_kv.runtime.generation import forward, prefill

from conftest import make_model, random_ids
from helpers import POLICIES, SCHEDULES, kept_positions, random_qkv, run_layer
from reference import reference_layer

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed (the dev extra has it)")
DEVICES = (["cpu"] if interpreted() else []) + (["cuda"] if torch.cuda.is_available() else [])


def literal(q, k, v, visible, scale):
    """float64 attention of q [B, Hq, n, D] over k/v [B, H, S, D] where `visible` [B, H, n, S]: the output
    [B, Hq, n, D] and each key's probability summed over queries and each KV group, [B, H, S]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    logits = (q.double() @ k.mT) * scale
    logits = logits.masked_fill(~visible.repeat_interleave(group, 1), float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    summed = probs.sum(2).view(q.shape[0], -1, group, k.shape[2]).sum(2)
    return probs @ v, summed, probs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("group,dim,holes", [(1, 16, True), (3, 32, False), (4, 16, True)])
def test_decode_kernel_matches_literal_attention(device, storage, group, dim, holes):
    from h2o_kv.backends.triton_decode import decode_attend

    if storage == "bfloat16" and device == "cpu":
        pytest.skip("bfloat16 tl.dot is wrong in Triton's interpreter")
    gen = torch.Generator().manual_seed(group * dim)
    batch, heads, slots = 2, 2, 75
    q = torch.randn(batch, heads * group, 1, dim, generator=gen) * 2
    k, v = torch.randn(2, batch, heads, slots, dim, generator=gen)
    pos = torch.randint(-1 if holes else 0, 90, (batch, heads, slots), generator=gen)
    pos[..., 0] = 5  # every head sees a token
    scales = (None, None)
    if storage == "int8":
        (k, ks), (v, vs) = quantize(k), quantize(v)
        scales = (ks, vs)
        k_ref, v_ref = dequantize(k, ks, torch.float32), dequantize(v, vs, torch.float32)
    else:
        dtype = getattr(torch, storage)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        k_ref, v_ref = k, v
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, scores, last = decode_attend(to(q), to(k), to(v), to(pos) if holes else None, scaling=dim**-0.5,
                                      key_scale=to(scales[0]), value_scale=to(scales[1]), want_scores=True,
                                      want_last=True)  # fmt: skip
    visible = (pos >= 0)[:, :, None] if holes else torch.ones(batch, heads, 1, slots, dtype=torch.bool)
    ref_out, ref_scores, probs = literal(q, k_ref, v_ref, visible, dim**-0.5)
    tol = 2e-2 if storage == "bfloat16" else 1e-5
    torch.testing.assert_close(out.cpu().double(), ref_out.transpose(1, 2), atol=tol, rtol=tol)
    torch.testing.assert_close(scores.cpu().double(), ref_scores, atol=tol, rtol=tol)
    ref_last = probs[:, :, 0].reshape(batch, heads, group, slots).mean(2)
    torch.testing.assert_close(last.cpu().double(), ref_last, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernels_compile_once_for_every_split_count(device):
    """The first pass takes its split count from the grid and the merge as a plain, unspecialised argument (a new
    batch bucket on a GPU reuses both compiled kernels); one sequence's attention is the literal one whether its
    slots are cut into 1, 2 or 4 splits."""
    from h2o_kv.backends import triton_decode

    assert "NSPLIT" not in triton_decode._partial.arg_names + triton_decode._merge.arg_names
    merge = triton_decode._merge
    flags = merge.kwargs["do_not_specialize"] if hasattr(merge, "kwargs") else merge.do_not_specialize  # interpreted
    assert "nsplit" in flags
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 2, 75, 16, generator=gen)
    pos = torch.randint(-1, 90, (2, 2, 75), generator=gen)
    pos[..., 0] = 5
    counts = []
    for rows, heads in ((2, 2), (1, 2), (1, 1)):  # 4, 2 and 1 (sequence, KV head) programs of the first kind
        qs, ks, vs, ps = q[:rows, : 2 * heads], k[:rows, :heads], v[:rows, :heads], pos[:rows, :heads]
        counts.append(triton_decode.splits(rows * heads, 75, torch.device(device)))
        out, scores, _ = triton_decode.decode_attend(qs.to(device), ks.to(device), vs.to(device), ps.to(device),
                                                     scaling=0.25, want_scores=True)  # fmt: skip
        ref_out, ref_scores, _ = literal(qs, ks, vs, (ps >= 0)[:, :, None], 0.25)
        torch.testing.assert_close(out.cpu().double(), ref_out.transpose(1, 2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores.cpu().double(), ref_scores, atol=1e-5, rtol=1e-5)
    if device == "cpu":  # the interpreter's four programs: each shape its own split count
        assert counts == [1, 2, 4]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["float32", "int8", "float32-write"])
@pytest.mark.parametrize("recent,ties,sinks", [(3, False, 0), (3, True, 0), (200, True, 0), (3, False, 20)])
def test_decode_evict_matches_the_torch_step(device, storage, recent, ties, sinks):
    """`decode_evict` against literal attention and the torch eviction (`Steady._evict_one` on a packed layer):
    the scores grown in place, each row's victim (the oldest of its lowest priorities; ties in score, and every slot
    protected when `recent` exceeds the row; `sinks`: positions below them protected too) freed, its slot in the
    vacant buffer. "-write": the new token given to
    the kernel, which writes it into the vacant slots (empty, score 0) the reference writes it into first."""
    from h2o_kv.backends.triton_evict import decode_evict

    write = storage.endswith("-write")
    storage = storage.removesuffix("-write")
    gen = torch.Generator().manual_seed(recent + ties)
    batch, heads, group, slots, dim = 2, 3, 2, 45, 16
    q = torch.randn(batch, heads * group, 1, dim, generator=gen) * 2
    k, v = torch.randn(2, batch, heads, slots, dim, generator=gen)
    pos = torch.stack([torch.randperm(60, generator=gen)[:slots] for _ in range(batch * heads)]).view(batch, heads, -1)
    score = torch.rand(batch, heads, slots, generator=gen)
    if ties:  # whole numbers: this step's probabilities (< 1 each) leave many rows with tied lowest scores
        score = torch.randint(0, 3, (batch, heads, slots), generator=gen).float() * 4
    next_pos = torch.tensor([61, 58]).view(batch, 1, 1)
    new, held = {}, (k, v, pos, score)
    if write:  # the vacant slots as the last eviction left them; the new token at position next_pos - 1
        vac = torch.randint(0, slots, (batch, heads, 1), generator=gen)
        new_k, new_v = torch.randn(2, batch, heads, 1, dim, generator=gen)
        held = (k.clone(), v.clone(), pos.scatter(2, vac, -1), score.scatter(2, vac, 0.0))
        new_pos = (next_pos - 1).view(batch, 1)
        k, v = (
            k.scatter(2, vac[..., None].expand(-1, -1, -1, dim), new_k),
            v.scatter(2, vac[..., None].expand(-1, -1, -1, dim), new_v),
        )
        pos, score = pos.scatter(2, vac, new_pos.view(batch, 1, 1).expand(batch, heads, 1)), score.scatter(2, vac, 0.0)
        new = dict(new_key=new_k, new_value=new_v, new_pos=new_pos)
    scales, k_ref, v_ref = (None, None), k, v
    if storage == "int8":
        (k, ks), (v, vs) = quantize(k), quantize(v)
        scales, k_ref, v_ref = (ks, vs), dequantize(k, ks, torch.float32), dequantize(v, vs, torch.float32)
    ref_out, summed, _ = literal(q, k_ref, v_ref, torch.ones(batch, heads, 1, slots, dtype=torch.bool), dim**-0.5)
    ref_score = score.double() + summed
    priority = torch.where((pos >= next_pos - recent) | (pos < sinks), float("inf"), ref_score)
    oldest = torch.where(priority == priority.amin(-1, keepdim=True), pos, torch.iinfo(torch.int64).max)
    victim = oldest.argmin(-1, keepdim=True)
    if sinks:  # the sinks changed some row's victim
        plain = torch.where(pos >= next_pos - recent, float("inf"), ref_score)
        plain = torch.where(plain == plain.amin(-1, keepdim=True), pos, torch.iinfo(torch.int64).max)
        assert not torch.equal(plain.argmin(-1, keepdim=True), victim)
    ref_pos, ref_score = pos.scatter(2, victim, -1), ref_score.scatter(2, victim, 0.0)

    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    pos_d, score_d = to((held[2] if write else pos).clone()), to((held[3] if write else score).clone())
    vacant = to(vac.clone() if write else torch.zeros(batch, heads, 1, dtype=torch.int64))
    k_d, v_d = to((held[0] if write else k).clone()), to((held[1] if write else v).clone())
    recent_t = torch.tensor(recent).view(1, 1, 1)
    new = {name: to(t) for name, t in new.items()}
    # a tensor even at 0 (no sinks): torch 2.11's custom-op dispatch drops trailing arguments left at their defaults
    # and then indexes the mutated `key_scale` past them (IndexError, on the lent H200); the library's one call
    # always passes the new token, so its calls never end in defaults
    sinks_t = to(torch.tensor(sinks).view(1, 1, 1))
    out = decode_evict(to(q), k_d, v_d, pos_d, score_d, vacant, to(next_pos), to(recent_t), scaling=dim**-0.5,
                       key_scale=to(scales[0]), value_scale=to(scales[1]), sinks=sinks_t, **new)  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), ref_out.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert torch.equal(k_d.cpu(), k) and torch.equal(v_d.cpu(), v)  # the token written; nothing else touched
    assert torch.equal(vacant.cpu(), victim)
    assert torch.equal(pos_d.cpu(), ref_pos)
    torch.testing.assert_close(score_d.cpu().double(), ref_score, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "old,n,score_from,window,group",
    [(0, 45, 0, None, 2), (20, 37, 5, None, 3), (0, 50, 0, 8, 4), (13, 33, 32, None, 1)],
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rows", "interleaved"])
def test_prompt_scores_match_literal_attention(device, old, n, score_from, window, group, interleaved):
    """`interleaved`: keys and positions given as per-head views of one row whose slots alternate heads (how a
    head-pooled layer hands a prompt over, pooled.py), so no stride but the feature one is 1."""
    from h2o_kv.backends.triton_scores import key_scores, row_lse

    gen = torch.Generator().manual_seed(n)
    batch, heads, dim = 2, 2, 16
    slots = old + n + 5  # storage reserved past the new tokens
    q = torch.randn(batch, heads * group, n, dim, generator=gen) * 2
    k = torch.randn(batch, heads, slots, dim, generator=gen)
    pos = torch.full((batch, heads, slots), -1)
    pos[..., : old + n] = torch.arange(old + n)
    if old:
        pos[0, 1, 3] = pos[1, 0, 7] = -1  # evicted old tokens: holes
    qpos = torch.arange(old, old + n).expand(batch, n).contiguous()
    if interleaved:
        k, pos = k.transpose(1, 2).contiguous().transpose(1, 2), pos.transpose(1, 2).contiguous().transpose(1, 2)
    lse = row_lse(q.to(device), k.to(device), pos.to(device), qpos.to(device), scaling=dim**-0.5, new_from=old,
                  window=window)  # fmt: skip
    scores = key_scores(q.to(device), k.to(device), pos.to(device), qpos.to(device), lse, scaling=dim**-0.5,
                        new_from=old, score_from=score_from, window=window)  # fmt: skip
    t = qpos[:, None, :, None]
    visible = (pos[:, :, None] >= 0) & (pos[:, :, None] <= t)
    if window is not None:
        visible &= pos[:, :, None] > t - window
    _, ref, _ = literal(q[:, :, score_from:], k, k, visible[:, :, score_from:], dim**-0.5)
    torch.testing.assert_close(scores.cpu().double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's log-sum-exp is a GPU's")
@pytest.mark.parametrize("new_from,group", [(0, 1), (0, 4), (300, 1), (300, 4)])
def test_flash_with_lse_matches_literal_attention(new_from, group):
    """A whole prompt (new_from 0) or a chunk after `new_from` earlier slots: flash attention's output and base-2
    log-sum-exp against float64 attention where query i sees slots 0 .. new_from + i."""
    from h2o_kv.backends.triton_scores import LOG2E, flash_with_lse

    gen = torch.Generator().manual_seed(new_from + group)
    n, heads, dim = 200, 2, 64
    q = torch.randn(1, heads * group, n, dim, generator=gen)
    k, v = torch.randn(2, 1, heads, new_from + n, dim, generator=gen)
    got = flash_with_lse(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), scaling=dim**-0.5, new_from=new_from)
    assert got is not None, "no flash kernel for this call on this GPU"
    visible = (torch.arange(new_from + n) <= torch.arange(new_from, new_from + n)[:, None]).expand(1, heads, n, -1)
    q, k, v = (t.bfloat16().double() for t in (q, k, v))  # the inputs the kernel read
    ref_out, _, _ = literal(q, k, v, visible, dim**-0.5)
    logits = (q @ k.repeat_interleave(group, 1).mT) * dim**-0.5
    ref_lse = logits.masked_fill(~visible.repeat_interleave(group, 1), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(got[0].cpu().double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].cpu().double() / LOG2E, ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("n,new_from,want_last", [(1, None, True), (29, 0, True), (17, 11, False)])
def test_attend_takes_the_triton_route_with_the_same_results(monkeypatch, n, new_from, want_last):
    if not interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter")
    gen = torch.Generator().manual_seed(n)
    old = new_from or 0
    q = torch.randn(2, 4, n, 16, generator=gen)
    k, v = torch.randn(2, 2, 2, old + n + 3, 16, generator=gen)
    pos = torch.full((2, 2, old + n + 3), -1)
    pos[..., : old + n] = torch.arange(old + n)
    qpos = torch.arange(old, old + n).expand(2, n)
    if n == 1:
        pos[0, 0, 2] = -1
    call = Call(scaling=0.25, new_from=new_from, want_scores=True, want_last=want_last)
    monkeypatch.setenv("H2O_KV_TRITON", "0")
    ref = attend(q, Slots(k, v, pos), qpos, call)
    monkeypatch.setenv("H2O_KV_TRITON", "1")
    calls = []
    from h2o_kv.backends import triton_decode, triton_scores

    for module, name in ((triton_decode, "decode_attend"), (triton_scores, "key_scores")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    got = attend(q, Slots(k, v, pos), qpos, call)
    assert calls, "the Triton kernels were not used"
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_layer_on_the_triton_kernels_matches_the_reference(monkeypatch, name, schedule, mode):
    """Every policy, schedule and mode of tests/cache/test_eviction.py with the Triton kernels doing the attention."""
    if not interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter (test_cuda.py covers CUDA)")
    monkeypatch.setenv("H2O_KV_TRITON", "1")
    policy, capacity, params = POLICIES[name]
    q, k, v = random_qkv(dim=16)
    chunks = SCHEDULES[schedule]
    out, layer = run_layer(policy, q, k, v, chunks, mode=mode)
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], chunks, name, capacity, params)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


@pytest.mark.parametrize("kv_dtype,sinks", [(None, 0), ("int8", 0), (None, 3)], ids=["float", "int8", "sinks"])
def test_steady_steps_on_the_triton_kernels_equal_the_torch_steps(monkeypatch, kv_dtype, sinks):
    """Decode steps of full layers on `decode_evict` (which writes the new token itself, int8 storage's quantized
    with its scales; `Sinks` around H2O: its first tokens kept there too) against the same steps in torch: the logits
    and the kept positions."""
    if not interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter (test_cuda.py covers CUDA)")
    from h2o_kv.backends import triton_evict

    model = make_model("llama")
    ids = random_ids(2, 12)
    runs, evicts = [], []
    monkeypatch.setattr(triton_evict, "decode_evict", lambda *a, f=triton_evict.decode_evict, **k:
                        evicts.append(k.get("sinks")) or f(*a, **k))  # fmt: skip
    for triton in ("0", "1"):
        evicts.clear()
        monkeypatch.setenv("H2O_KV_TRITON", triton)
        policy = h2o_kv.H2O(heavy=4, recent=4)
        cache = h2o_kv.KVCache(h2o_kv.Sinks(policy, sinks=sinks) if sinks else policy, kv_dtype=kv_dtype,
                               compile_kernel=False)  # fmt: skip
        with torch.inference_mode():
            token, position, logits = prefill(model, cache, ids).argmax(-1), torch.full((2,), 12), []
            for _ in range(6):
                logits.append(forward(model, cache, token.view(-1, 1), positions=position.view(-1, 1)))
                token, position = logits[-1].argmax(-1), position + 1
        assert all(layer.packed for layer in cache.layers)  # the last steps were the steady ones
        assert bool(evicts) == (triton == "1") and all((s is not None) == bool(sinks) for s in evicts)
        if sinks:  # the sinks stayed, and the steps evicted
            assert all(all(set(range(sinks)) <= set(head) for head in kept_positions(layer)) for layer in cache.layers)
        runs.append((torch.stack(logits), [kept_positions(layer) for layer in cache.layers]))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-4, rtol=1e-4)
    assert runs[1][1] == runs[0][1]


@pytest.mark.parametrize("triton", ["0", "1"], ids=["torch", "triton"])
@pytest.mark.parametrize("eager_steps", [0, 2])
def test_compiled_decode_step_equals_eager(monkeypatch, triton, eager_steps):
    """torch.compile(fullgraph=True) over whole decode steps, from right after the prompt (the storage grows once,
    then every step is steady) or after eager steps that leave the layers packed (on the Triton kernels the steady
    step is then `triton_evict.decode_evict`): the eager logits and kept tokens, step after step."""
    monkeypatch.setenv("H2O_KV_TRITON", triton)
    model = make_model("llama")
    ids = random_ids(2, 12)
    caches = [h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4), compile_kernel=False) for _ in range(2)]
    tokens = [prefill(model, cache, ids).argmax(-1) for cache in caches]

    def step(cache, token, position):
        return forward(model, cache, token.view(-1, 1), positions=position.view(-1, 1))

    compiled = torch.compile(step, fullgraph=True)
    position = torch.full((2,), 12)
    with torch.inference_mode():
        for i in range(6 + eager_steps):
            fast = compiled if i >= eager_steps else step
            eager, fast = step(caches[0], tokens[0], position), fast(caches[1], tokens[1], position)
            torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
            tokens = [eager.argmax(-1), fast.argmax(-1)]
            position = position + 1
    assert [kept_positions(layer) for layer in caches[1].layers] == [kept_positions(la) for la in caches[0].layers]
    assert caches[1].seen_tokens == caches[0].seen_tokens == 18 + eager_steps
    if eager_steps:
        assert all(layer.packed for layer in caches[1].layers)


def test_generate_compiles_the_decode_step_with_a_kvcache():
    """`model.generate` compiles the decode step where it compiles StaticCache's (here forced on a CPU), with the
    same tokens as without compiling; a mask-mode cache says it cannot be compiled."""
    from transformers.generation.configuration_utils import CompileConfig

    model = make_model("qwen2")
    ids = random_ids(2, 10)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3), compile_kernel=False)
    assert cache.is_compileable and not h2o_kv.KVCache(h2o_kv.H2O(budget=6), mode="mask").is_compileable
    compiled = model.generate(ids, past_key_values=cache, compile_config=config, **kwargs)
    eager = model.generate(ids, past_key_values=h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3)), disable_compile=True,
                           **kwargs)  # fmt: skip
    assert torch.equal(compiled, eager)
    assert cache.kept_tokens == 6


def test_a_captured_step_needs_a_cuda_model():
    from h2o_kv.runtime.graphs import CapturedStep

    model = make_model("llama")
    with pytest.raises(ValueError, match="CapturedStep needs a model on a CUDA device, got cpu"):
        CapturedStep(model, h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4)))

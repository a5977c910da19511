"""int8 KV storage (KVCache(kv_dtype="int8")): close to float storage, same kept tokens, ~1/4 of the bytes."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.cache.layer import KVLayer, Settings
from h2o_kv.cache.pooled import PooledKVLayer
from h2o_kv.cache.quant import dequantize, quantize

from conftest import make_model, random_ids
from helpers import INT8_TOLERANCE, decode, kept_positions, random_qkv, run_layer
from helpers import POLICIES as LAYER_POLICIES

UNEVICTED = [h2o_kv.Full(), h2o_kv.H2O(heavy=32, recent=32)]  # 40 tokens fit: only quantization differs
BY_POSITION = [h2o_kv.Local(window=12), h2o_kv.StreamingLLM(sinks=2, window=10)]  # evict the same tokens


def test_quantize_round_trip_error_is_half_a_step():
    x = torch.randn(3, 2, 50, 16) * torch.logspace(-3, 2, 50).view(1, 1, 50, 1)  # tokens of very different size
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert int(q.abs().max()) == 127
    error = (dequantize(q, scale, torch.float32) - x).abs()
    assert bool((error <= scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("policy", UNEVICTED + BY_POSITION, ids=lambda p: p.describe())
def test_int8_logits_close_to_float_storage(arch, policy):
    model, ids = make_model(arch), random_ids(2, 40)
    float_cache, int8_cache = h2o_kv.KVCache(policy), h2o_kv.KVCache(policy, kv_dtype="int8")
    expected = decode(model, ids, float_cache, prefill=20)
    got = decode(model, ids, int8_cache, prefill=20)
    torch.testing.assert_close(got, expected, **INT8_TOLERANCE)
    assert (got - expected).abs().max() > 0  # the storage really is quantized
    assert int8_cache.kept_per_head().tolist() == float_cache.kept_per_head().tolist()
    for a, b in zip(int8_cache.layers, float_cache.layers):
        assert torch.equal(a.pos.sort(-1).values, b.pos.sort(-1).values)


@pytest.mark.parametrize("name", ["h2o", "local", "streaming", "tova", "keydiff", "adakv"])
@pytest.mark.parametrize("chunks", [[1] * 16, [16], [7, 1, 1, 5, 1, 1]], ids=["steps", "one_call", "mixed"])
def test_int8_layer_equals_float_layer_on_the_quantized_values(name, chunks):
    """The only difference int8 storage makes is the rounding of keys and values: a float layer fed
    the dequantized inputs keeps exactly the same tokens and gives the same outputs."""
    policy = LAYER_POLICIES[name][0] if name != "adakv" else h2o_kv.AdaKV(h2o_kv.H2O(heavy=3, recent=2))
    q, k, v = random_qkv(batch=2, seed=3)
    k_rounded, v_rounded = (dequantize(*quantize(t), torch.float32) for t in (k, v))
    out, layer = run_layer(policy, q, k_rounded, v_rounded, chunks)
    layer_class = PooledKVLayer if policy.head_pooled else KVLayer
    int8_out, int8_layer = _run(layer_class(Settings(policy, kv_dtype="int8"), 0), q, k, v, chunks)
    assert int8_layer.keys.dtype == torch.int8 and int8_layer.key_scale.dtype == torch.float32
    for row in range(2):
        assert kept_positions(int8_layer, row) == kept_positions(layer, row)
    torch.testing.assert_close(int8_out, out, atol=1e-5, rtol=1e-5)
    assert not torch.equal(k_rounded, k)


def _run(layer, q, k, v, chunks):
    outs, start = [], 0
    for size in chunks:
        layer.update(k[:, :, start : start + size], v[:, :, start : start + size])
        mask = torch.ones(size, size, dtype=torch.bool).tril()[None, None].expand(q.shape[0], 1, -1, -1)
        outs.append(layer.forward_attention(q[:, :, start : start + size], mask, scaling=q.shape[-1] ** -0.5))
        start += size
    return torch.cat(outs, dim=1), layer


def test_int8_bytes_are_a_quarter_of_float32_plus_scales():
    model, ids = make_model("llama"), random_ids(2, 60)
    policy = h2o_kv.H2O(heavy=16, recent=16)
    caches = {kv: h2o_kv.KVCache(policy, kv_dtype=kv) for kv in (None, "int8")}
    with torch.no_grad():
        for cache in caches.values():
            model(ids, past_key_values=cache, use_cache=True)
    assert caches["int8"].kept_per_head().tolist() == caches[None].kept_per_head().tolist()
    float_layer, int8_layer = caches[None].layers[0], caches["int8"].layers[0]
    batch, heads, slots, dim = float_layer.keys.shape
    assert int8_layer.keys.shape == float_layer.keys.shape and int8_layer.keys.element_size() == 1
    per_slot = {None: 2 * dim * 4 + 8 + 4, "int8": 2 * dim + 2 * 4 + 8 + 4}  # keys+values (+scales), pos, score
    for kv, cache in caches.items():
        assert cache.nbytes() == len(cache.layers) * batch * heads * slots * per_slot[kv]
    kv_bytes = {kv: sum(layer.keys.nbytes + layer.values.nbytes for layer in c.layers) for kv, c in caches.items()}
    assert kv_bytes["int8"] * 4 == kv_bytes[None]


def _kept(layer, row: int) -> dict[str, torch.Tensor]:
    """A row's kept slots in position order: positions, int8 keys/values and their scales."""
    order = layer.pos[row].argsort(-1)[:, -int(layer.kept()[row].min()) :]  # kept slots (pos >= 0) last
    out = {"pos": layer.pos[row].gather(1, order)}
    for name in ("keys", "values", "key_scale", "value_scale"):
        t = getattr(layer, name)[row]
        out[name] = t.gather(1, order.view(*order.shape, *([1] * (t.dim() - 2))).expand(*order.shape, *t.shape[2:]))
    return out


def test_int8_rows_move_with_their_scales():
    model, ids = make_model("llama"), random_ids(3, 30)
    cache, other = (h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4), kv_dtype="int8") for _ in range(2))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        model(ids[:1], past_key_values=other, use_cache=True)
    before = [(_kept(layer, 2), _kept(theirs, 0)) for layer, theirs in zip(cache.layers, other.layers)]
    cache.select_rows([2])
    cache.append_rows(other)
    for layer, (mine, theirs) in zip(cache.layers, before):
        for row, want in ((0, mine), (1, theirs)):
            got = _kept(layer, row)
            assert all(torch.equal(got[name], want[name]) for name in want)


def test_int8_and_float_caches_do_not_join():
    model, ids = make_model("llama"), random_ids(1, 10)
    policy = h2o_kv.H2O(heavy=4, recent=4)
    a, b = h2o_kv.KVCache(policy), h2o_kv.KVCache(policy, kv_dtype="int8")
    with torch.no_grad():
        model(ids, past_key_values=a, use_cache=True)
        model(ids, past_key_values=b, use_cache=True)
    with pytest.raises(ValueError, match="kv_dtype"):
        a.append_rows(b)


@pytest.mark.parametrize("bad", ["int4", "float8", torch.int8, 8, ""])
def test_invalid_kv_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="kv_dtype"):
        h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4), kv_dtype=bad)


def test_int8_decoding_widens_into_one_reused_buffer():
    """The eager kernel (compile_kernel=False) widens each layer's int8 keys and values into the cache's buffer,
    not a fresh tensor per layer (new memory costs page faults): one buffer, kept across steps, the same outputs."""
    from h2o_kv.cache.attend import attend_one

    model, ids = make_model("llama"), random_ids(2, 40)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=8, recent=8), kv_dtype="int8", compile_kernel=False)
    decode(model, ids[:, :34], cache, prefill=30)
    work = cache.settings._work
    layer = cache.layers[0]
    assert work is not None and work.numel() >= layer.keys.numel() + layer.values.numel()
    with torch.no_grad():
        for t in range(34, 40):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    assert cache.settings._work is work  # the same buffer for every layer and step
    q = torch.randn(2, model.config.num_attention_heads, 1, layer.keys.shape[-1])
    args = (q, layer.keys, layer.values, layer.pos)
    options = dict(scaling=0.125, want_scores=True, key_scale=layer.key_scale, value_scale=layer.value_scale)
    out, scores, _ = attend_one(*args, work=work, **options)
    fresh_out, fresh_scores, _ = attend_one(*args, **options)
    assert torch.equal(out, fresh_out) and torch.equal(scores, fresh_scores)


@pytest.mark.parametrize("storage", ["int8", "float32", "bfloat16"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(
    "batch,heads,group,slots,dim",
    [(2, 2, 3, 37, 16), (3, 1, 1, 64, 64), (1, 3, 2, 5, 24), (2, 2, 4, 129, 8)],
    ids=["gqa", "mha", "tail_dim", "odd_slots"],
)
def test_kernel_equals_the_eager_path(batch, heads, group, slots, dim, softcap, storage):
    """h2o-kv's C++ kernel (native.attend_one) gives attend_one's output, scores and last-query attention
    over the same int8 (with scales), float32 or bfloat16 storage (widened in registers: the float32 call on the
    same numbers, up to the compiler's order in the tails) and empty slots, for slot counts and head sizes off
    the vector width."""
    from h2o_kv.backends import native
    from h2o_kv.cache.attend import attend_one

    torch.manual_seed(slots)
    q = torch.randn(batch, heads * group, 1, dim)
    keys, values = torch.randn(batch, heads, slots, dim) * 3, torch.randn(batch, heads, slots, dim)
    scales = {}
    if storage == "int8":
        (keys, key_scale), (values, value_scale) = quantize(keys), quantize(values)
        scales = dict(key_scale=key_scale, value_scale=value_scale)
    if storage == "bfloat16":
        keys, values = keys.bfloat16(), values.bfloat16()
    pos = torch.arange(slots).repeat(batch, heads, 1)
    pos[0, -1, 1 : slots // 2] = -1
    options = dict(scaling=dim**-0.5, softcap=softcap, want_scores=True, want_last=True)
    got = native.attend_one(q, keys, values, pos, scaling=dim**-0.5, softcap=softcap, **scales)
    expected = attend_one(q, keys, values, pos, **scales, **options)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert float(got[1][0, -1, 1 : slots // 2].abs().max()) == 0.0  # an empty slot gets no attention
    if storage == "bfloat16":
        wide = native.attend_one(q, keys.float(), values.float(), pos, scaling=dim**-0.5, softcap=softcap)
        for a, b in zip(got, wide):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # pos None (every slot holds a token, as a packed layer's decode step passes): nothing masked
    got = native.attend_one(q, keys, values, None, scaling=dim**-0.5, softcap=softcap, **scales)
    expected = attend_one(q, keys, values, None, **scales, **options)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_storage_without_its_scales():
    from h2o_kv.backends import native

    q, keys = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    (k8, scale) = quantize(keys)
    with pytest.raises(RuntimeError, match="int8 keys/values come with float32 scales"):
        native.attend_one(q, k8, k8, None, scaling=1.0)
    with pytest.raises(RuntimeError, match="int8 keys/values come with float32 scales"):
        native.attend_one(q, keys, keys, None, scaling=1.0, key_scale=scale, value_scale=scale)
    with pytest.raises(RuntimeError, match="int8, bfloat16 or float32 keys/values"):
        native.attend_one(q, keys.double(), keys.double(), None, scaling=1.0)


@pytest.mark.parametrize("storage", ["int8", "float32", "bfloat16"])
def test_decoding_runs_the_kernel_with_the_eager_results(arch, monkeypatch, storage):
    """Where the kernel can be built (here), an int8, float32 or bfloat16 cache decodes through it (counted),
    and its logits and kept tokens are those of the eager path (compile_kernel=False; for a bfloat16 model the
    eager path with float32 products, as on a CPU without bfloat16 ones, since the kernel multiplies in float32)."""
    from h2o_kv.backends import native
    from h2o_kv.cache import attend as kernels

    calls = []
    for name in ("attend_one", "decode_step"):  # a full layer's steady step runs the second (layer._decode_full)
        kernel = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *a, kernel=kernel, name=name, **k: calls.append(name) or kernel(*a, **k)
        )
    model, ids = make_model(arch), random_ids(2, 40)
    kv_dtype = "int8" if storage == "int8" else None
    if storage == "bfloat16":
        model = model.to(torch.bfloat16)
        monkeypatch.setattr(kernels, "native_products", lambda dtype: False)
    policy = h2o_kv.H2O(heavy=8, recent=8)
    eager, cache = (
        h2o_kv.KVCache(policy, kv_dtype=kv_dtype, compile_kernel=False),
        h2o_kv.KVCache(policy, kv_dtype=kv_dtype),
    )
    assert cache.settings.compile_kernel and not eager.settings.compile_kernel
    expected = decode(model, ids, eager, prefill=20)
    assert not calls
    got = decode(model, ids, cache, prefill=20)
    tolerance = 2e-2 if storage == "bfloat16" else 1e-4  # a bfloat16 model rounds each layer's output
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert len(calls) >= 20 and "decode_step" in calls  # every decode step of a layer (not the sliding ones)
    for a, b in zip(cache.layers, eager.layers):
        assert torch.equal(a.pos.sort(-1).values, b.pos.sort(-1).values)


def test_compile_kernel_is_checked(monkeypatch):
    from h2o_kv.backends import native

    policy = h2o_kv.H2O(heavy=4, recent=4)
    with pytest.raises(TypeError, match="compile_kernel must be None, True or False"):
        h2o_kv.KVCache(policy, kv_dtype="int8", compile_kernel="yes")
    assert h2o_kv.KVCache(policy).settings.compile_kernel  # they can be built here
    monkeypatch.setattr(native, "missing", lambda: "ninja is not installed (pip install ninja)")
    with pytest.raises(RuntimeError, match="cannot be built here: ninja is not installed"):
        h2o_kv.KVCache(policy, kv_dtype="int8", compile_kernel=True)
    assert not h2o_kv.KVCache(policy, kv_dtype="int8").settings.compile_kernel  # the eager path where it cannot

"""fused_model.py: a Llama model's steady decode step over a KVCache in one C++ call, held to the per-layer path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel

import h2o_kv
from h2o_kv import fused_model
from h2o_kv.fused_model import FusedLlamaModel, use_fused_model
from h2o_kv.generation import forward
from h2o_kv.layer import KVLayer
from h2o_kv.rows_first import use_rows_first

from conftest import biased_llama, make_model, random_ids
from reference import reference_layer

pytestmark = pytest.mark.skipif(h2o_kv.native.missing() is not None, reason="h2o-kv's C++ kernels cannot be built")


def pair(build, dtype=torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same model twice with rows-first: one with the per-layer path (its LlamaModel swapped back), one fused."""
    per_layer, fused = build().to(dtype), build().to(dtype)
    use_rows_first(per_layer)
    use_rows_first(fused)
    assert type(fused.model) is FusedLlamaModel
    plain = LlamaModel.__new__(LlamaModel)
    plain.__dict__.update(per_layer.model.__dict__)
    per_layer.model = plain
    return per_layer, fused


def model_steps(monkeypatch) -> list[int]:
    """Records each `native.model_step` call (its batch size)."""
    calls, step = [], fused_model.native.model_step
    monkeypatch.setattr(
        fused_model.native, "model_step", lambda hidden, *a: calls.append(hidden.shape[0]) or step(hidden, *a)
    )
    return calls


def assert_same_cache(a: h2o_kv.KVCache, b: h2o_kv.KVCache) -> None:
    """Every layer's storage, scores, positions and bookkeeping equal to the bit."""
    for x, y in zip(a.layers, b.layers, strict=True):
        for name in ("keys", "values", "pos", "score", "last", "key_scale", "value_scale", "next_pos", "capacity"):
            s, t = getattr(x, name), getattr(y, name)
            assert (s is None and t is None) or torch.equal(s, t), (x.layer_idx, name)
        assert (x.seen, x.kept_bound, x.decoded) == (y.seen, y.kept_bound, y.decoded)
        assert torch.equal(x.vacant[0], y.vacant[0]) and y.vacant[1] is y.pos


POLICIES = {
    "h2o": lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4)),
    "h2o-int8": lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=4, recent=4), kv_dtype="int8"),
    "snapkv": lambda: h2o_kv.KVCache(h2o_kv.SnapKV(budget=8, window=4)),
    "h2o-fraction": lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy_ratio=0.2, recent_ratio=0.2)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("build", [lambda: make_model("llama"), lambda: biased_llama(3)], ids=["llama", "biased"])
def test_decode_steps_equal_the_per_layer_path_to_the_bit(build, policy, dtype, monkeypatch):
    """A 16-token prompt at batch 3, then twelve decode steps: once the cache is full every step is one C++ call
    (counted), and the logits and every layer's cache are those of the per-layer path, bit for bit."""
    per_layer, fused = pair(build, dtype)
    calls = model_steps(monkeypatch)
    ids = random_ids(3, 28)
    caches = [POLICIES[policy](), POLICIES[policy]()]
    with torch.no_grad():
        for cols in [slice(0, 16)] + [slice(t, t + 1) for t in range(16, 28)]:
            a = forward(per_layer, caches[0], ids[:, cols], all_logits=True)
            b = forward(fused, caches[1], ids[:, cols], all_logits=True)
            assert torch.equal(a, b), cols
    assert calls == [3] * 11  # the first decode step fills the storage's last slot; every later one is fused
    assert_same_cache(*caches)
    assert caches[1].kept_tokens == caches[0].kept_tokens <= 8 + 1


def test_a_batch_of_twenty_takes_the_fused_step_to_the_bit(monkeypatch):
    """Up to native.MAX_ROWS rows (64) the kernels take the step: the same-memory batch of 20 decodes through
    model_step (counted), its logits and cache the per-layer path's, bit for bit."""
    per_layer, fused = pair(lambda: make_model("llama"))
    calls = model_steps(monkeypatch)
    ids = random_ids(20, 22)
    caches = [POLICIES["h2o"](), POLICIES["h2o"]()]
    with torch.no_grad():
        for cols in [slice(0, 16)] + [slice(t, t + 1) for t in range(16, 22)]:
            assert torch.equal(forward(per_layer, caches[0], ids[:, cols]), forward(fused, caches[1], ids[:, cols]))
    assert calls == [20] * 5
    assert_same_cache(*caches)


def test_the_fused_steps_keep_the_tokens_of_the_literal_reference(monkeypatch):
    """tests/reference.py (docs/eviction.md read literally, float64) fed each layer's queries, keys and values as
    the per-layer path computes them (recorded there): after a prompt and ten decode steps, nine of them fused,
    every (layer, sequence, KV head) of the fused model's cache keeps the reference's positions."""
    per_layer, fused = pair(lambda: make_model("llama"))
    heavy, recent, prompt, total = 3, 2, 10, 20
    chunks = [prompt] + [1] * (total - prompt)
    calls, record = model_steps(monkeypatch), {}
    original = KVLayer.forward_attention

    def recording(self, query, attention_mask, **kwargs):
        keys, values = self.pending
        record.setdefault(self.layer_idx, []).append((query, keys, values))
        return original(self, query, attention_mask, **kwargs)

    ids = random_ids(2, total)
    caches = [h2o_kv.KVCache(h2o_kv.H2O(heavy=heavy, recent=recent)) for _ in range(2)]
    with torch.no_grad():
        monkeypatch.setattr(KVLayer, "forward_attention", recording)
        for start, size in zip([0, *torch.tensor(chunks).cumsum(0).tolist()], chunks):
            forward(per_layer, caches[0], ids[:, start : start + size])
        monkeypatch.setattr(KVLayer, "forward_attention", original)
        for start, size in zip([0, *torch.tensor(chunks).cumsum(0).tolist()], chunks):
            forward(fused, caches[1], ids[:, start : start + size])
    assert calls == [2] * 9  # the first decode step fills the storage; the nine after it are fused
    for layer in caches[1].layers:
        q, k, v = (torch.cat(parts, dim=2) for parts in zip(*record[layer.layer_idx]))  # [B, heads, total, D]
        for row in range(2):
            _, kept = reference_layer(q[row], k[row], v[row], chunks, "h2o", heavy + recent, {"recent": recent})
            ours = [sorted(int(p) for p in head[head >= 0]) for head in layer.pos[row]]
            assert ours == kept, (layer.layer_idx, row)


def test_generate_with_padding_takes_the_fused_step_and_the_same_tokens(monkeypatch):
    """transformers' generate (a left-padded batch, its attention mask and keyword arguments): the same tokens,
    and the decode steps after the first go through the C++ call."""
    per_layer, fused = pair(lambda: make_model("llama"))
    calls = model_steps(monkeypatch)
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    run = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    cache = lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=3, recent=3))  # noqa: E731
    tokens = [m.generate(ids, past_key_values=cache(), **run) for m in (per_layer, fused)]
    assert torch.equal(tokens[0], tokens[1])
    assert calls == [2] * 6  # the prompt and the first decode step take the per-layer path


def test_what_the_fused_step_cannot_take_goes_to_the_layers(monkeypatch):
    """A cache still filling, another cache, output capture, a hook, a padded new token, a policy ranking
    otherwise (TOVA) or a head-pooled cache (AdaKV): no C++ call, and the per-layer path's results."""
    per_layer, fused = pair(lambda: make_model("llama"))
    calls = model_steps(monkeypatch)
    ids = random_ids(2, 14)
    full = lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=2, recent=2))  # noqa: E731
    with torch.no_grad():
        caches = [full(), full()]
        for model, cache in zip((per_layer, fused), caches):
            forward(model, cache, ids[:, :8])
            forward(model, cache, ids[:, 8:9])
        out = [
            m(ids[:, 9:10], past_key_values=c, output_hidden_states=True) for m, c in zip((per_layer, fused), caches)
        ]
        for a, b in zip(out[0].hidden_states, out[1].hidden_states, strict=True):
            assert torch.equal(a, b)
        seen = []
        hook = fused.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
        fused(ids[:, 10:11], past_key_values=caches[1])
        hook.remove()
        assert seen == [1]
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, -1] = 0  # a padded new token: the per-layer path decides what that means
        with pytest.raises(ValueError, match="right padding"):
            fused(ids[:, 11:12], past_key_values=caches[1], attention_mask=mask)
        for cache in (lambda: DynamicCache(config=fused.config),
                      lambda: h2o_kv.KVCache(h2o_kv.TOVA(budget=4)),
                      lambda: h2o_kv.KVCache(h2o_kv.AdaKV(h2o_kv.H2O(heavy=2, recent=2))),
                      lambda: h2o_kv.KVCache(h2o_kv.H2O(heavy=8, recent=8))):  # fmt: skip
            pair_caches = [cache(), cache()]
            for t in range(8, 11):
                cols = slice(0, 8) if t == 8 else slice(t, t + 1)
                a, b = (forward(m, c, ids[:, cols]) for m, c in zip((per_layer, fused), pair_caches))
                assert torch.equal(a, b)
    assert calls == []


def test_the_swap_keeps_the_modules_and_swaps_llama_only(arch):
    model = make_model(arch)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    use_rows_first(model)
    assert type(model.base_model) is (FusedLlamaModel if arch == "llama" else type(model.base_model))
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before  # same tensors, same keys
    assert use_fused_model(model) == 0  # the second call swaps nothing
    if arch == "llama":
        assert (
            model.lm_head.weight is not None
            and model.model.embed_tokens.weight.data_ptr() == before["model.embed_tokens.weight"]
        )


def test_the_op_refuses_lists_of_other_lengths():
    x = torch.randn(1, 1, 8)
    cos = sin = torch.randn(1, 1, 4)
    with pytest.raises(RuntimeError, match="9 weights, 7 biases"):
        torch.ops.h2o_kv.model_step(x, cos, sin, [x], [None], [1e-6, 1e-6], [1.0], 4, [x], [x], [None], [None], [x],
                                    [x], [None], [x], [x], [x], [x])  # fmt: skip

"""Query-agnostic policies: KeyDiff (keys only) and KVzip's context-reconstruction pass, against the literal reference
of docs/eviction.md (tests/reference.py), against a stock model's own attention, and through `h2o_kv.compress`,
`generate` and the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import h2o_kv
from h2o_kv.cache.layer import KVLayer, Settings
from h2o_kv.cache.pooled import PooledKVLayer
from h2o_kv.cache.reconstruct import Reconstruction
from h2o_kv.policies import AdaKV, KeyDiff, KVzip, LayerBudgets, Sinks, build
from h2o_kv.runtime.compress import compress, reconstruction_inputs

from conftest import make_model, random_ids
from helpers import causal_mask, kept_positions, random_qkv, run_layer
from reference import reference_layer, reference_reconstruction, reference_whole_cache

# -- KeyDiff ----------------------------------------------------------------------------------------------------


def test_keydiff_keeps_the_keys_least_like_the_others():
    """Twelve keys that all point one way and four that do not: the four are what a budget of four keeps."""
    q, k, v = random_qkv(total=16, kv_heads=2, seed=4)
    gen = torch.Generator().manual_seed(1)
    k[:] = torch.randn(8, generator=gen) + 0.05 * torch.randn(k.shape, generator=gen)  # one direction, a little noise
    distinct = {0: [2, 5, 9, 11], 1: [0, 6, 7, 13]}
    for head, positions in distinct.items():
        k[0, head, positions] = torch.randn(len(positions), 8, generator=gen) * 3
    _, layer = run_layer(KeyDiff(budget=4, recent=0), q, k, v, [16])
    assert kept_positions(layer) == [distinct[0], distinct[1]]


@pytest.mark.parametrize("mode", ["drop", "mask"])
@pytest.mark.parametrize(
    "case", ["sinks", "window", "prefill_chunk", "mqa", "recent_0"], ids=lambda c: c
)  # fmt: skip
def test_keydiff_variants_match_the_reference(case, mode):
    """Beyond tests/helpers.py's matrix: protected sinks, a sliding layer (the window frees first, the anchor is
    what is left), a chunked prefill, one KV head, and the paper's rule without a recent window."""
    policy, params, window, chunk, kv_heads = KeyDiff(budget=5, recent=2), {"recent": 2}, None, None, 2
    if case == "sinks":
        policy, params = Sinks(policy, sinks=2), {"recent": 2, "protect": 2}
    elif case == "window":
        window = 7  # wider than the budget: KeyDiff still ranks what the window leaves
    elif case == "prefill_chunk":
        chunk = 3
    elif case == "mqa":
        kv_heads = 1
    else:
        policy, params = KeyDiff(budget=5, recent=0), {"recent": 0}
    q, k, v = random_qkv(kv_heads=kv_heads, total=20, seed=9)
    calls = [12, 1, 1, 4, 1, 1]
    out, layer = run_layer(policy, q, k, v, calls, mode=mode, window=window, prefill_chunk=chunk)
    schedule = [3, 3, 3, 3, 1, 1, 3, 1, 1, 1] if chunk else calls
    ref_out, ref_kept = reference_layer(q[0], k[0], v[0], schedule, "keydiff", 5, params, window=window)
    torch.testing.assert_close(out[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert kept_positions(layer) == ref_kept


def test_keydiff_builds_by_name_scales_by_layer_and_refuses_adakv():
    assert build("keydiff", 0.2) == KeyDiff(budget=0.2) and build("KeyDiff", 64) == KeyDiff(budget=64)
    assert LayerBudgets(KeyDiff(budget=64)).for_layer(0, SimpleNamespace(num_hidden_layers=2)).budget == 125
    with pytest.raises(ValueError, match="AdaKV cannot pool KeyDiff"):
        AdaKV(KeyDiff(budget=8))
    with pytest.raises(TypeError, match="recent"):
        KeyDiff(budget=8, recent=None)


# -- KVzip: the pass on one layer, against the reference ---------------------------------------------------------


def run_pass(policy, q, k, v, pieces, steps, *, mode="drop", native=False, window=None, chunk=None, held=None):
    """One layer through KVzip's pass: the context (q/k/v [B, *, T, D] less the last `steps` tokens) held whole (in
    calls of the sizes `held` gives, else one), each piece (q, k, v) scored, then the `steps` tokens decoded one by
    one. Returns the outputs of every call (the held calls' joined), the layer, the kept positions when the pass
    ended, and the storage's slots after each piece."""
    settings = Settings(policy, mode, chunk, compile_kernel=native)
    layer = (PooledKVLayer if policy.head_pooled else KVLayer)(settings, 0)
    batch, length = q.shape[0], q.shape[2] - steps
    scaling, slots = q.shape[-1] ** -0.5, []

    def call(qs, ks, vs):
        layer.update(ks, vs)
        mask = causal_mask(torch.ones(batch, qs.shape[2], dtype=torch.bool))
        return layer.forward_attention(qs, mask, scaling=scaling, window=window)

    with Reconstruction(settings, [layer]) as rec:
        bounds = [0, *torch.tensor(held or [length]).cumsum(0).tolist()]
        outs = [torch.cat([call(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:])], 1)]
        for piece in pieces:
            with rec.scoring():
                outs.append(call(*piece))
            slots.append(layer.keys.shape[2])
            assert int(layer.next_pos.max()) == length and layer.seen == length  # the piece is not in the sequence
    compressed = [kept_positions(layer, row) for row in range(batch)]
    for t in range(length, length + steps):
        outs.append(call(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]))
    return outs, layer, compressed, slots


WINDOWED = KVzip(budget=5, recent=2, window=3, share=0.5)
WINDOW = {"recent": 2, "window": 3, "share": 0.5, "half": 3}  # WINDOWED's rule
PASSES = {  # name: (policy, reference params but the context's length, KV heads, batch, window, prefill chunk)
    "gqa": (KVzip(budget=5, recent=2), {"recent": 2}, 2, 1, None, None),
    "window": (WINDOWED, WINDOW, 2, 1, None, None),
    "window_mqa_batch": (WINDOWED, WINDOW, 1, 2, None, None),
    "window_sliding": (WINDOWED, WINDOW, 2, 1, 8, 5),
    "window_adakv": (AdaKV(WINDOWED), {**WINDOW, "pooled": True}, 2, 1, None, None),
    "mqa_batch": (KVzip(budget=5, recent=2), {"recent": 2}, 1, 2, None, None),
    "chunked_context": (KVzip(budget=5, recent=3), {"recent": 3}, 2, 1, None, 5),
    "sliding": (KVzip(budget=5, recent=2), {"recent": 2}, 2, 1, 8, None),
    "sinks": (Sinks(KVzip(budget=5, recent=2), sinks=1), {"recent": 2, "protect": 1}, 2, 1, None, None),
    "adakv": (AdaKV(KVzip(budget=5, recent=2)), {"recent": 2, "pooled": True}, 2, 1, None, None),
}


@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("mode", ["drop", "mask"])
@pytest.mark.parametrize("name", sorted(PASSES))
def test_kvzip_pass_and_decoding_match_the_reference(name, mode, native, monkeypatch):
    """The context's and the pieces' outputs, the kept tokens when the pass ends (each head's top-capacity by the
    most attention a reconstruction query gave it), and every decode step after (H2O's accumulation on top, the
    newest tokens after the context kept; a full layer's step in h2o-kv's C++ kernel, counted); the storage never
    holds more than the context and one piece."""
    from h2o_kv.backends import native as kernels

    steps_in_kernel = []
    for fused in ("decode_step", "pooled_decode_step"):
        original = getattr(kernels, fused)
        monkeypatch.setattr(kernels, fused, lambda *a, f=original, **k: steps_in_kernel.append(1) or f(*a, **k))
    policy, params, kv_heads, batch, window, chunk = PASSES[name]
    length, steps, capacity = 12, 8, 5
    q, k, v = random_qkv(batch=batch, total=length + steps, kv_heads=kv_heads, seed=21)
    pieces = [random_qkv(batch=batch, total=m, kv_heads=kv_heads, seed=30 + m) for m in (6, 4, 7)]
    held = [10, 1, 1] if name.startswith("window") else None  # the window's queries span three held calls
    outs, layer, compressed, slots = run_pass(policy, q, k, v, pieces, steps, mode=mode, native=native,
                                              window=window, chunk=chunk, held=held)  # fmt: skip
    per_token = kv_heads if policy.head_pooled else 1  # a pooled row holds a token's heads side by side
    assert slots == [per_token * (length + m) for m in (6, 6, 7)]  # the context and the largest piece so far
    params = {**params, "context": length}
    for row in range(batch):
        context_out, piece_outs, kept = reference_reconstruction(
            q[row, :, :length], k[row, :, :length], v[row, :, :length], [(p[0][row], p[1][row], p[2][row]) for p in
            pieces], capacity, params, window=window,
        )  # fmt: skip
        torch.testing.assert_close(outs[0][row].double(), context_out, atol=1e-5, rtol=1e-5)
        for got, want in zip(outs[1:4], piece_outs):
            torch.testing.assert_close(got[row].double(), want, atol=1e-5, rtol=1e-5)
        assert compressed[row] == [sorted(tok.pos for tok in head) for head in kept]
        decoded, ref_kept = reference_layer(q[row], k[row], v[row], [1] * steps, "kvzip", capacity, params,
                                            window=window, kept=kept, start=length)  # fmt: skip
        torch.testing.assert_close(torch.cat(outs[4:], 1)[row].double(), decoded[length:], atol=1e-5, rtol=1e-5)
        assert kept_positions(layer, row) == ref_kept
    # a mask-mode or sliding layer's step is the general one; Sinks' runs in the kernel, its sinks kept there too
    in_kernel = native and mode == "drop" and window is None
    assert len(steps_in_kernel) >= (steps - 2 if in_kernel else 0) and (in_kernel or not steps_in_kernel)
    for row in compressed:  # each head its capacity; AdaKV's heads share theirs, unevenly
        assert [len(head) for head in row] == [capacity] * kv_heads or (name == "adakv" and sum(map(len, row)) ==
                                                                        capacity * kv_heads)  # fmt: skip


@pytest.mark.parametrize("with_window", [False, True], ids=["kvzipwhole", "window"])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "kernels"])
def test_kvzip_whole_cache_ranks_every_layer_together_and_decodes_at_each_layers_share(native, with_window):
    """Three head-pooled layers through one pass: what each keeps equals the reference's one ranking over every
    (layer, KV head) (each head's best kept); the layers end at different sizes summing to the budget, and decoding
    afterwards holds each layer at its own share, as the reference layer does at that capacity. With a window
    (`kvzipwindow`'s rule): the context's last queries' picks ranked first, its newest tokens protected."""
    window = dict(window=3, share=0.2) if with_window else {}  # 2 picks a layer: the ranking still shares the rest
    policy = AdaKV(KVzip(budget=5, recent=2, whole_cache=True, **window))
    settings = Settings(policy, "drop", None, compile_kernel=native)
    layers = [PooledKVLayer(settings, i) for i in range(3)]
    length, steps, kv_heads = 12, 6, 2
    data = [random_qkv(total=length + steps, kv_heads=kv_heads, seed=40 + i) for i in range(3)]
    pieces = [[random_qkv(total=m, kv_heads=kv_heads, seed=50 + 10 * i + m) for m in (6, 4)] for i in range(3)]
    scaling = data[0][0].shape[-1] ** -0.5

    def call(layer, qs, ks, vs):
        layer.update(ks, vs)
        return layer.forward_attention(qs, causal_mask(torch.ones(1, qs.shape[2], dtype=torch.bool)), scaling=scaling)

    with Reconstruction(settings, layers) as rec:
        for layer, (q, k, v) in zip(layers, data):
            call(layer, q[:, :, :length], k[:, :, :length], v[:, :, :length])
        for p in range(2):
            with rec.scoring():
                for layer, layer_pieces in zip(layers, pieces):
                    call(layer, *layer_pieces[p])
    rule = {"recent": 2, "context": length, **({**WINDOW, **window, "pooled": True, "pick_capacity": 5} if with_window
                                                else {})}  # fmt: skip
    scored = [reference_reconstruction(q[0, :, :length], k[0, :, :length], v[0, :, :length],
                                       [(pq[0], pk[0], pv[0]) for pq, pk, pv in layer_pieces], length, rule)[2]
              for (q, k, v), layer_pieces in zip(data, pieces)]  # fmt: skip
    want = reference_whole_cache(scored, 5, protect_from=length - 3 if with_window else None)
    assert [kept_positions(layer) for layer in layers] == [[sorted(t.pos for t in h) for h in lay] for lay in want]
    sizes = [sum(map(len, lay)) for lay in want]
    assert sum(sizes) == 5 * kv_heads * 3 and len(set(sizes)) > 1  # the budget, shared unevenly by the layers
    params = {"recent": 2, "pooled": True, "context": length, **({**WINDOW, **window} if with_window else {})}
    for layer, (q, k, v), kept, size in zip(layers, data, want, sizes):
        outs = [call(layer, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(length,
                length + steps)]  # fmt: skip
        decoded, ref_kept = reference_layer(q[0], k[0], v[0], [1] * steps, "kvzip", size / kv_heads, params,
                                            kept=kept, start=length)  # fmt: skip
        torch.testing.assert_close(torch.cat(outs, 1)[0].double(), decoded[length:], atol=1e-5, rtol=1e-5)
        assert kept_positions(layer) == ref_kept and sum(map(len, ref_kept)) == size


@pytest.mark.parametrize("name", ["kvzip", "kvzipwhole"])
def test_a_context_within_the_budget_decodes_up_to_it(name, tiny_tokenizer):
    """A short prompt under a token budget loses nothing in KVzip's pass, and its cache then holds up to the budget
    per (layer, KV head) while decoding, per head or ranked as one cache (whose layers would otherwise shrink to the
    prompt and evict from the first generated token)."""
    model = make_model("llama")
    cache = compress(model, random_ids(1, 20, seed=3), build(name, 32), tokenizer=tiny_tokenizer, chunk=16)
    assert cache.kept_tokens == 20
    with torch.no_grad():
        for step in range(20):
            model(random_ids(1, 1, seed=step), past_key_values=cache, use_cache=True)
    assert cache.seen_tokens == 40 and cache.kept_tokens == 32  # 12 evicted: the budget, not the prompt's 20


def test_whole_cache_needs_pooled_rows_and_is_not_served():
    with pytest.raises(ValueError, match="AdaKV"):
        Reconstruction(Settings(KVzip(budget=4, whole_cache=True)), [])
    assert build("kvzipwhole", 0.25) == AdaKV(KVzip(budget=0.25, whole_cache=True))


def test_kvzipwindow_builds_by_name_and_refuses_windows_that_mean_nothing():
    assert build("kvzipwindow", 0.25) == AdaKV(KVzip(budget=0.25, whole_cache=True, window=32, share=0.3))
    assert build("kvziplayerwindow", 64) == AdaKV(KVzip(budget=64, window=32, share=0.6))
    assert "window=32, share=0.3" in build("kvzipwindow", 0.25).describe()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="share"):
            KVzip(budget=8, window=4, share=bad)
    with pytest.raises(ValueError, match="window"):
        KVzip(budget=8, window=-1)


def test_the_pass_refuses_what_it_cannot_rank():
    settings = Settings(h2o_kv.H2O(heavy=2, recent=2))
    with pytest.raises(ValueError, match="KVzip"):
        Reconstruction(settings, [])
    settings = Settings(KVzip(budget=4))
    layer = KVLayer(settings, 0)
    rec = Reconstruction(settings, [layer])
    with pytest.raises(ValueError, match="holds its context first"), rec, rec.scoring():
        pass
    q, k, v = random_qkv(total=8)
    with pytest.raises(RuntimeError, match="boom"), Reconstruction(settings, [layer]):
        layer.update(k, v)
        layer.forward_attention(q, causal_mask(torch.ones(1, 8, dtype=torch.bool)), scaling=0.3)
        raise RuntimeError("boom")
    assert not layer.is_initialized  # a failed pass leaves an empty layer, not one over its capacity


# -- KVzip through a model ---------------------------------------------------------------------------------------


def test_kvzip_keeps_the_top_capacity_by_the_models_own_reconstruction_attention(tiny_tokenizer):
    """Each (layer, KV head) keeps exactly its 10 context tokens with the most attention from any reconstruction
    query, computed here from a stock eager model's attention weights over [context; piece]; the cache held at
    most the context and one piece meanwhile, and decoding afterwards holds the capacity."""
    model, stock = make_model("llama"), make_model("llama", enable=False)
    stock.set_attn_implementation("eager")
    ctx, capacity, length = random_ids(1, 40, seed=5), 10, 40
    cache = h2o_kv.KVCache(KVzip(budget=capacity, recent=4))
    held = []

    def note(*_):
        held.append(max(layer.keys.shape[2] for layer in cache.layers if layer.keys is not None))

    hooks = [block.register_forward_hook(note) for block in model.model.layers]
    compress(model, ctx, tokenizer=tiny_tokenizer, chunk=16, cache=cache)
    for hook in hooks:
        hook.remove()
    pieces = reconstruction_inputs(tiny_tokenizer, ctx, chunk=16)
    assert len(pieces) == 3 and max(held) == length + max(piece.shape[1] for piece, _ in pieces)
    config = model.config
    heads, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    scores = torch.zeros(config.num_hidden_layers, heads, length)
    with torch.no_grad():
        for piece, _ in pieces:
            attentions = stock(torch.cat([ctx, piece], 1), output_attentions=True).attentions
            for i, weights in enumerate(attentions):  # [1, Hq, n, n]: the piece's queries on the context
                seen = weights[0, :, length:, :length].reshape(heads, group, -1, length).amax(dim=(1, 2))
                scores[i] = torch.maximum(scores[i], seen)
    for i, layer in enumerate(cache.layers):
        top = scores[i].topk(capacity, dim=-1).indices.sort(-1).values
        assert kept_positions(layer) == top.tolist()
        kept = layer.pos[0] >= 0
        torch.testing.assert_close(layer.score[0][kept], scores[i].gather(-1, layer.pos[0].clamp(min=0))[kept])
    assert layer.keys.shape[2] == capacity + 1  # compacted back to a bounded layer's storage
    ids = torch.cat([ctx, random_ids(1, 6, seed=6)], 1)
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert bool((cache.kept_per_head() == capacity).all()) and cache.seen_tokens == length + 6 + 11
    for layer in cache.layers:  # the 4 newest tokens after the context are kept in every head
        newest = set(range(length + 17 - 4, length + 17))
        assert all(newest <= set(head) for head in kept_positions(layer))


@pytest.mark.filterwarnings("ignore:.*too few for coherent text")
def test_compressing_a_left_padded_batch_equals_each_row_alone(tiny_tokenizer):
    model = make_model("llama")
    long, short = random_ids(1, 37, seed=7), random_ids(1, 22, seed=8)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 15, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :15] = 0
    policy = KVzip(budget=0.25)  # a fraction: 9 and 5 tokens, each row's own
    both = compress(model, batch, policy, tokenizer=tiny_tokenizer, attention_mask=mask, chunk=12)
    alone = [compress(model, row, policy, tokenizer=tiny_tokenizer, chunk=12) for row in (long, short)]
    for row, single in enumerate(alone):
        for a, b in zip(both.layers, single.layers):
            assert kept_positions(a, row) == kept_positions(b)
            kept_a, kept_b = a.pos[row] >= 0, b.pos[0] >= 0
            torch.testing.assert_close(a.score[row][kept_a], b.score[0][kept_b], atol=1e-5, rtol=1e-4)
    assert both.kept_per_head()[:, 0].max() == 9 and both.kept_per_head()[:, 1].max() == 5


def test_kvzip_compressed_once_answers_many_questions_from_forks(tiny_tokenizer):
    """The documented pattern: a fork per question generates what a cache compressed for that question alone
    would; the compressed context stays as it was."""
    model, doc = make_model("qwen3"), random_ids(1, 30, seed=2)
    cache = compress(model, doc, KVzip(budget=8), tokenizer=tiny_tokenizer, chunk=16)
    kept = cache.kept_per_head().clone()
    for seed in range(2):
        ids = torch.cat([doc, random_ids(1, 5, seed=10 + seed)], 1)
        fresh = compress(model, doc, KVzip(budget=8), tokenizer=tiny_tokenizer, chunk=16)
        with torch.no_grad():
            got = model.generate(ids, past_key_values=cache.fork(), max_new_tokens=5, do_sample=False)
            want = model.generate(ids, past_key_values=fresh, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, want)
        assert torch.equal(cache.kept_per_head(), kept) and cache.get_seq_length() == 30


def test_a_plain_prompt_call_refuses_kvzip_and_leaves_the_cache_to_compress(llama, tiny_tokenizer):
    cache = h2o_kv.KVCache(KVzip(budget=8))
    with pytest.raises(ValueError, match=r"h2o_kv\.compress"), torch.no_grad():
        llama(random_ids(1, 20), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0
    compress(llama, random_ids(1, 20), tokenizer=tiny_tokenizer, chunk=8, cache=cache)
    assert cache.kept_tokens == 8 and cache.get_seq_length() == 20
    with pytest.raises(ValueError, match="empty KVCache"), cache.reconstruction():
        pass
    with pytest.raises(ValueError, match="tokenizer="):
        compress(llama, random_ids(1, 20), KVzip(budget=8))


def test_compress_with_any_other_policy_is_its_prompt_call(llama):
    ids = random_ids(2, 30, seed=4)
    compressed = compress(llama, ids, KeyDiff(budget=8))
    plain = h2o_kv.KVCache(KeyDiff(budget=8))
    with torch.no_grad():
        llama(ids, past_key_values=plain, use_cache=True)
    for a, b in zip(compressed.layers, plain.layers):
        assert torch.equal(a.pos, b.pos)
    assert compressed.kept_tokens == 8


# -- the engine and the CLI serve both (the engine runs KVzip's pass: tests/runtime/test_engine_kvzip.py) -----------


def test_the_engine_serves_kvzip_and_keydiff_by_name(tiny_tokenizer):
    from h2o_kv.runtime.engine import Engine

    model = make_model("llama")
    engine = Engine(model, tiny_tokenizer, policy="kvzip", budget=8)
    assert engine.resolve_policy() == KVzip(budget=8)
    done = engine.generate(list(range(3, 30)), policy="kvzip", budget=8, max_tokens=4, ignore_eos=True)
    assert done.completion_tokens == 4 and engine.waiting() == 0
    done = engine.generate(list(range(3, 30)), policy="keydiff", budget=6, max_tokens=4, ignore_eos=True)
    assert done.completion_tokens == 4


def test_the_cli_generates_with_kvzip(monkeypatch, capsys, tiny_tokenizer):
    from h2o_kv import cli
    from h2o_kv.runtime import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (make_model("llama"), tiny_tokenizer))
    assert cli.main(["generate", "hi there", "--policy", "kvzip", "--budget", "8", "--max-new-tokens", "3"]) == 0
    assert "[KVzip(budget=8, recent=8)] kept" in capsys.readouterr().err

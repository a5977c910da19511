"""`kept_map` and `h2o-kv inspect`: the map against the layers' own slots, the bounded summary, every bad input (one
line, exit 2), a 32k-token page, and the bundled model's 4k-token needle page read back from headless Chromium's DOM:
SnapKV keeps the needle, H2O does not, and every token carries the kept fraction the cache reported."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import h2o_kv
from h2o_kv import cli, policies
from h2o_kv.cache.kept import KeptMap, kept_map
from h2o_kv.runtime import models
from h2o_kv.studies.inspect import run as inspect_run
from h2o_kv.studies.inspect.page import render
from h2o_kv.studies.inspect.run import Inspection, Run

from conftest import make_model, random_ids

CHROMIUM = Path("/usr/bin/chromium")
NEEDLE = "One of the special magic numbers for rusty-lantern is: 4719305."
QUESTION = "What are all the special magic numbers for rusty-lantern mentioned in the provided text?"
HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)


def reference_map(cache, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kept [layers, heads, positions] and score, slot by slot from each layer's `pos`, `score` (and `head`)."""
    n = int(cache.layers[0].next_pos[row].max())
    heads = cache.layers[0].kv_heads
    kept = torch.zeros(len(cache.layers), heads, n, dtype=torch.bool)
    score = torch.zeros(len(cache.layers), heads, n)
    for index, layer in enumerate(cache.layers):
        pos = layer.pos[row]
        for r in range(pos.shape[0]):
            for slot in range(pos.shape[1]):
                p = int(pos[r, slot])
                if p >= 0:
                    h = int(layer.head[row, 0, slot]) if layer.head is not None else r
                    assert not kept[index, h, p], "a position held twice by one row"
                    kept[index, h, p] = True
                    score[index, h, p] = layer.score[row, r, slot]
    return kept, score


@pytest.mark.filterwarnings("ignore:.*too few for coherent text")
@pytest.mark.parametrize(
    "name, mode",
    [("h2o", "drop"), ("snapkv", "mask"), ("adakv", "drop"), ("adakv", "mask"), ("globalkv", "drop"),
     ("tova", "mask"), ("full", "drop")],
)  # fmt: skip
def test_kept_map_is_what_the_layers_hold(name, mode) -> None:
    """Two left-padded sequences, a prompt and three decode steps: the map equals the slots, its counts equal
    `kept_per_head`, and positions count each sequence's real tokens."""
    model = make_model("llama")
    cache = h2o_kv.KVCache(policies.build(name, None if name == "full" else 0.4), mode=mode)
    ids = random_ids(2, 40)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(3):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
    for row, seen in ((0, 43), (1, 37)):
        got = h2o_kv.kept_map(cache, row)
        kept, score = reference_map(cache, row)
        assert got.positions == seen and torch.equal(got.kept, kept)
        torch.testing.assert_close(got.score, score)
        assert torch.equal(got.kept_per_row(), cache.kept_per_head()[:, row])
        assert got.rows == 2 * 2 and torch.equal(got.count(), kept.sum((0, 1)))
        assert got.kept_bytes == cache.row_stats(row).kv_kept_bytes
        if name == "full":
            assert bool((got.fraction() == 1).all())
    assert torch.equal(cache.kept_map(1).kept, kept)


def test_kept_map_refuses_an_empty_cache_and_a_bad_row() -> None:
    cache = h2o_kv.KVCache(policies.build("h2o", 8))
    with pytest.raises(ValueError, match="holds nothing yet"):
        kept_map(cache)
    with torch.no_grad():
        make_model("llama")(random_ids(1, 12), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"row in \[0, 1\)"):
        kept_map(cache, 1)


def synthetic(layers: int, heads: int, positions: int, share: float = 0.2, seed: int = 0) -> KeptMap:
    gen = torch.Generator().manual_seed(seed)
    kept = torch.rand(layers, heads, positions, generator=gen) < share
    score = torch.rand(layers, heads, positions, generator=gen) * kept
    return KeptMap(kept, score, torch.full((layers,), heads), 12345, "H2O(budget=0.2)")


def test_summary_is_bounded_and_averages_bins() -> None:
    kept = synthetic(24, 2, 32768)
    summary = kept.summary(30000)
    assert summary["prompt_tokens"] == 30000 and summary["bin"] == 15  # ceil(30000 / 2048)
    values = summary["position_kept_fraction"]
    assert len(values) == 2000 and len(summary["layer_kept_fraction"]) == 24
    assert all(len(line) == 64 for line in summary["layer_position_kept_fraction"])
    assert values[0] == round(float(kept.fraction()[:15].mean()), 3)
    assert len(json.dumps(summary)) < 40_000
    small = kept.summary(100)
    assert small["bin"] == 1 and small["position_kept_fraction"] == [
        round(v, 3) for v in kept.fraction()[:100].tolist()
    ]


def _bad_cases(tmp_path: Path) -> dict[str, tuple[list[str], str, str]]:
    binary, nul, blank = tmp_path / "binary.bin", tmp_path / "nul.txt", tmp_path / "blank.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x81")
    nul.write_bytes(b"text\x00with a NUL")
    blank.write_text(" \n\t\n")
    return {
        "empty_argument": ([""], "", "the prompt is empty"),
        "empty_stdin": ([], "", "the prompt is empty"),
        "blank_file": ([str(blank)], "", "the prompt is empty"),
        "unknown_policy": (["hi", "--policy", "lru"], "", "unknown policy 'lru'"),
        "unknown_policy_with_budget": (["hi", "--policy", "h2o", "--policy", "nope@0.1"], "", "unknown policy 'nope'"),
        "bad_budget": (["hi", "--policy", "snapkv@1.5"], "", "means nothing"),
        "repeated_policy": (["hi", "--policy", "h2o", "--policy", "h2o@0.2"], "", "given twice"),
        "binary_file": ([str(binary)], "", "not UTF-8"),
        "nul_file": ([str(nul)], "", "not text"),
        "directory": (["--file", str(tmp_path)], "", "is a directory"),
        "missing_file": (["--file", str(tmp_path / "nope.txt")], "", "does not exist"),
        "empty_question": (["hi", "--question", " "], "", "--question is empty"),
        "out_folder_missing": (["hi", "--out", str(tmp_path / "no" / "page.html")], "", "does not exist"),
        "decode_negative": (["hi", "--decode", "-1"], "", "at least 0"),
    }


def _exit_line(argv: list[str], stdin: str, monkeypatch, capsys) -> tuple[int, list[str]]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(["inspect", *argv])
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return code, captured.err.strip().splitlines()


@pytest.mark.parametrize("case", sorted(_bad_cases(Path("/tmp")).keys()))
def test_bad_input_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys) -> None:
    argv, stdin, message = _bad_cases(tmp_path)[case]
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded for bad input"))
    code, lines = _exit_line(argv, stdin, monkeypatch, capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0] and lines[0].startswith("h2o-kv: error:"), lines


def test_a_prompt_past_the_context_exits_2_with_one_line(tokenizer, tmp_path, monkeypatch, capsys) -> None:
    from serve_helpers import tiny_model

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (tiny_model(tokenizer, context=64), tokenizer))
    code, lines = _exit_line(["word " * 80, "--model", "smollm2-135m", "--out", str(tmp_path / "p.html")], "",
                             monkeypatch, capsys)  # fmt: skip
    assert code == 2 and len(lines) == 1 and "more than the model's context of 64 tokens" in lines[0], lines
    assert not (tmp_path / "p.html").exists()


def _inspection(positions: int, layers: int = 24, heads: int = 2) -> Inspection:
    words = ["the ", "needle ", "<b>&amp;", "\n", "x"]
    tokens = [words[i % len(words)] for i in range(positions)]
    runs = [
        Run(label, label, synthetic(layers, heads, positions, share, seed), f"answer {label} <i>", 3, 1 << 20, 1.0)
        for seed, (label, share) in enumerate((("snapkv@0.2", 0.2), ("h2o@0.2", 0.2)))
    ]
    return Inspection("tiny", "What <is> it?", tokens, runs)


def test_a_32k_token_page_is_quick_self_contained_and_a_few_mb() -> None:
    inspection = _inspection(32768)
    start = time.perf_counter()
    page = render(inspection)
    took = time.perf_counter() - start
    assert took < 5.0, f"rendering 32k tokens took {took:.1f} s"
    assert len(page.encode()) < 6 * 2**20, f"{len(page.encode()) / 2**20:.1f} MiB"
    lowered = page.lower()
    assert "http://" not in lowered and "https://" not in lowered and "<script src" not in lowered
    assert "What &lt;is&gt; it?" in page and "answer h2o@0.2 &lt;i&gt;" in page and "&lt;b&gt;&amp;amp;" in page
    assert page.count("data:image/png;base64,") == 2


class Columns(HTMLParser):
    """Each text column of a page's DOM: its policy and its spans' (data-k, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: dict[str, list[list]] = {}
        self.current: list | None = None
        self.span: list | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and "text" in (attrs.get("class") or "").split():
            self.current = self.columns.setdefault(attrs["data-policy"], [])
        elif tag == "span" and self.current is not None:
            self.span = [float(attrs["data-k"]), ""]
            self.current.append(self.span)

    def handle_endtag(self, tag):
        if tag == "span":
            self.span = None
        elif tag == "div":
            self.current = None

    def handle_data(self, data):
        if self.span is not None:
            self.span[1] += data


def chromium_dom(page: Path, tmp_path: Path, fragment: str = "") -> str:
    """The page's DOM after its scripts ran, from headless Chromium (skips where Debian's chromium is missing)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium): the page is checked in a real browser")
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", f"{page.resolve().as_uri()}{fragment}"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


def test_chromium_loads_a_32k_token_page(tmp_path) -> None:
    inspection = _inspection(32768)
    page = tmp_path / "long.html"
    page.write_text(render(inspection), encoding="utf-8")
    start = time.perf_counter()
    parser = Columns()
    parser.feed(chromium_dom(page, tmp_path, "#q=needle"))
    took = time.perf_counter() - start
    assert sorted(parser.columns) == ["h2o@0.2", "snapkv@0.2"] and took < 120
    for run in inspection.runs:
        spans = parser.columns[run.label]
        assert len(spans) == 32768 and "".join(text for _, text in spans) == "".join(inspection.tokens)
        assert [k for k, _ in spans[:50]] == [round(v, 3) for v in run.kept.fraction()[:50].tolist()]


# -- the bundled model and a 4k-token needle prompt -----------------------------------------------------------------


def needle_text(tokenizer, tokens: int = 3900, depth: float = 0.4) -> str:
    """RULER's niah_single shape (ruler_build.py): a header, Shakespeare as the haystack (the offline corpus) and the
    needle at `depth`, on a sentence boundary; about `tokens` tokens without the question."""
    from h2o_kv.studies.data import load_corpus

    words = load_corpus(max_chars=60000).split()

    def build(n: int) -> str:
        at = int(n * depth)
        while at < n and not words[at - 1].endswith("."):
            at += 1
        return f"{HEADER}\n\n{' '.join(words[:at])} {NEEDLE} {' '.join(words[at:n])}"

    n = 2400
    while len(tokenizer(build(n + 25))["input_ids"]) <= tokens:
        n += 25
    return build(n)


@pytest.fixture(scope="module")
def needle_page(tmp_path_factory):
    """`h2o-kv inspect` of a 4k-token needle prompt on smollm2-135m under SnapKV and H2O at 20 %: the page and the
    inspection the command drew it from."""
    try:
        model, tokenizer = h2o_kv.load_model("smollm2-135m")
    except FileNotFoundError as err:  # pragma: no cover - only without `make setup`
        pytest.skip(str(err))
    folder = tmp_path_factory.mktemp("inspect")
    prompt, page = folder / "needle.txt", folder / "needle.html"
    prompt.write_text(needle_text(tokenizer), encoding="utf-8")
    seen: list[Inspection] = []
    real = inspect_run.inspect

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_model", lambda *a, **k: (model, tokenizer))
        patch.setattr(inspect_run, "inspect", spy)
        argv = [str(prompt), "--model", "smollm2-135m", "--policy", "snapkv", "--policy", "h2o", "--budget", "0.2",
                "--question", QUESTION, "--decode", "6", "--out", str(page)]  # fmt: skip
        assert cli.main(["inspect", *argv]) == 0
    return page, seen[0]


# appended to a copy of the page: hovers one token of each column and writes what the tooltip says into the DOM
HOVER = """<script>
const probe=document.createElement('pre');probe.id='probe';document.body.appendChild(probe);
for(const box of document.querySelectorAll('.text')){
 box.children[POSITION].dispatchEvent(new MouseEvent('mouseover',{bubbles:true,clientX:20,clientY:20}));
 probe.textContent+=document.getElementById('tip').innerText.replace(/\\n/g,' ')+'\\n';}
</script></body>"""


@pytest.mark.slow
@pytest.mark.xdist_group("needle-page")  # one process draws the page for both
def test_the_needle_page_shows_snapkv_keeping_the_needle_and_h2o_not(needle_page, tmp_path) -> None:
    page, inspection = needle_page
    assert 3900 < inspection.prompt_tokens <= 4096
    position = inspection.prompt_tokens // 3
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", HOVER.replace("POSITION", str(position))))
    dom = chromium_dom(probe, tmp_path)
    parser = Columns()
    parser.feed(dom)
    tips = dom.split('<pre id="probe">')[1].split("</pre>")[0].strip().splitlines()
    for run, tip in zip(inspection.runs, tips):  # hovering a token: its position, count per layer and score
        tip = tip.strip()
        per_layer = run.kept.per_layer()[:, position].tolist()
        assert tip.startswith(f"{run.label} position {position} ")
        assert f"kept by {sum(per_layer)} of {run.kept.rows} rows" in tip
        assert tip.endswith(f"kept per layer (0 to {len(per_layer) - 1}): {' '.join(map(str, per_layer))}"), tip
    assert sorted(parser.columns) == ["h2o@0.2", "snapkv@0.2"]
    share = {}
    for run in inspection.runs:
        spans = parser.columns[run.label]
        reported = run.kept.fraction()[: inspection.prompt_tokens]
        assert len(spans) == inspection.prompt_tokens
        # every token carries the kept fraction the cache reported (3 decimals)
        assert max(abs(k - float(f)) for (k, _), f in zip(spans, reported)) <= 5e-4
        text = "".join(t for _, t in spans)
        starts = torch.tensor([0] + [len(t) for _, t in spans]).cumsum(0)[:-1]
        at = text.index(NEEDLE)
        needle = ((starts >= at) & (starts < at + len(NEEDLE))).nonzero().flatten()
        assert len(needle) >= 15
        share[run.label] = float(reported[needle].mean())
        assert run.kept.positions == inspection.prompt_tokens + run.new_tokens - 1
    assert share["snapkv@0.2"] > 0.5 > 0.3 > share["h2o@0.2"], share


@pytest.mark.slow
@pytest.mark.xdist_group("needle-page")  # one process draws the page for both
def test_the_needle_page_is_self_contained(needle_page) -> None:
    page, inspection = needle_page
    text = page.read_text(encoding="utf-8")
    assert "https://" not in text and "http://" not in text and text.count("data:image/png;base64,") == 2
    assert QUESTION in text and len(text.encode()) < 2 * 2**20
    for run in inspection.runs:
        assert run.new_tokens >= 1 and run.kept.kept_bytes > 0

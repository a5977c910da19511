"""`h2o-kv serve` starting: a taken port is refused before the model loads; the start-up line says what it serves."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("fastapi")

from h2o_kv import cli  # noqa: E402
from h2o_kv.runtime import models  # noqa: E402
from h2o_kv.runtime.serve import server  # noqa: E402
from h2o_kv.runtime.serve.main import startup_line  # noqa: E402

from serve_helpers import MODEL, bundled_tokenizer, tiny_model  # noqa: E402


@pytest.fixture
def no_loading(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", tripwire)


def test_a_taken_port_is_one_line_and_exit_2_before_the_model_loads(no_loading, capsys):
    with socket.socket() as taken:  # another server on the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["serve", "--host", "127.0.0.1", "--port", str(port)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.splitlines() == [
        f"h2o-kv: error: serve: 127.0.0.1:{port} is already in use (another server?): stop it or choose another --port"
    ]


def test_a_bad_policy_budget_pair_is_one_line_and_exit_2_before_the_model_loads(no_loading, capsys):
    code = cli.main(["serve", "--port", "0", "--policy", "h2o", "--budget", "1.5"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and len(captured.err.splitlines()) == 1


def test_kvzip_is_served(monkeypatch):
    """The engine runs KVzip's reconstruction pass, so `serve --policy kvzip` starts (tests/runtime/test_engine_kvzip.py
    serves it)."""
    tokenizer = bundled_tokenizer()
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (tiny_model(tokenizer), tokenizer))
    seen = []
    monkeypatch.setattr(server.Server, "run", lambda self: seen.append(self.announce))
    assert cli.main(["serve", "--port", "0", "--model", "smollm2-135m", "--policy", "kvzip", "--budget", "0.2"]) == 0
    assert len(seen) == 1 and "policy kvzip" in seen[0]


def test_the_start_up_line_names_model_policy_budget_and_kv_memory(monkeypatch):
    """`serve` hands the server a line naming what it serves with (the run is stopped there)."""
    tokenizer = bundled_tokenizer()
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: (tiny_model(tokenizer), tokenizer))
    seen = []
    monkeypatch.setattr(server.Server, "run", lambda self: seen.append(self.announce))
    argv = ["serve", "--port", "0", "--model", "smollm2-135m", "--policy", "h2o", "--budget", "64",
            "--kv-memory", "256MiB", "--max-batch", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    assert seen == [
        "model smollm2-135m on cpu, policy h2o, budget 64 tokens per sequence and KV head, KV memory 256 MiB "
        "(float32 keys and values), up to 4 sequences at once"
    ]
    assert cli.main(["serve", "--port", "0", "--budget", "20%", "--kv-dtype", "int8", "--served-model-name", "m"]) == 0
    assert seen[1].startswith("model m on cpu, policy kvzipwindow, budget 20% of each prompt per KV head, KV "
                              "memory 1 GiB (int8 keys and values)")  # fmt: skip


def test_the_server_prints_the_line_once_it_listens(capfd):
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.runtime.serve.app import create_app

    tokenizer = bundled_tokenizer()
    engine = Engine(tiny_model(tokenizer), tokenizer, policy="full", kv_memory=None, max_batch=2)
    line = startup_line(engine, MODEL)
    assert line == f"model {MODEL} on cpu, policy full, keeping every token, KV memory unbounded (float32 keys and " \
                   "values), up to 2 sequences at once"  # fmt: skip
    with server.serve_in_thread(create_app(engine, MODEL), engine, announce=line) as url:
        pass
    assert capfd.readouterr().err.splitlines().count(f"h2o-kv serve: ready at {url}: {line}") == 1


def test_prompts_are_read_in_gpu_sized_chunks_on_a_gpu_unless_told():
    """--prefill-chunk's default follows --device (a prompt chunk on a GPU is one matrix product of 2,048 rows, where
    256 would leave it mostly idle); an explicit size is kept; a size below 1 is one line."""
    from h2o_kv.cli import build_parser
    from h2o_kv.runtime.serve.main import engine_settings

    parse = build_parser().parse_args
    assert engine_settings(parse(["serve"]))["prefill_chunk"] == 256
    assert engine_settings(parse(["serve", "--device", "cuda"]))["prefill_chunk"] == 2048
    assert engine_settings(parse(["serve", "--device", "cuda:1"]))["prefill_chunk"] == 2048
    assert engine_settings(parse(["serve", "--device", "cuda", "--prefill-chunk", "512"]))["prefill_chunk"] == 512
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 1"):
        engine_settings(parse(["serve", "--prefill-chunk", "0"]))

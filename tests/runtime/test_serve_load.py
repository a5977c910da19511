"""`h2o-kv serve` under concurrency: batch invariance, a bounded load test within --kv-memory,
graceful shutdown (in process and by SIGTERM), the serve flags, and the load generator at a tiny size."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import httpx  # noqa: E402

from h2o_kv import policies  # noqa: E402
from h2o_kv.runtime.serve.main import parse_bytes  # noqa: E402

from serve_helpers import MODEL, client, running_server, wait_for  # noqa: E402

LIMIT_S = 120  # every concurrent phase below must finish well within this


class Sampler:
    """Polls engine.stats() in a thread: the largest values seen of each field."""

    def __init__(self, engine) -> None:
        self.engine, self.peak, self._stop = engine, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + LIMIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            for key, value in self.engine.stats().items():
                if isinstance(value, int):
                    self.peak[key] = max(self.peak.get(key, 0), value)
            time.sleep(0.002)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _mixed_requests(n: int, seed: int) -> list[dict]:
    """Prompts of different lengths (token ids), each with its own policy, budget and token limit."""
    rng = random.Random(seed)
    kinds = [("h2o", 8), ("local", 0.5), ("streamingllm", 12), ("tova", 0.25), ("full", None), ("h2o", "30%")]
    out = []
    for i in range(n):
        policy, budget = kinds[i % len(kinds)]
        extra = {"kv_policy": policy} | ({} if budget is None else {"kv_budget": budget})
        ids = [rng.randrange(5, 40000) for _ in range(6 + 11 * i % 97)]
        out.append(dict(prompt=ids, max_tokens=5 + i % 7, extra_body=extra, stream=i % 3 == 0))
    return out


def _complete(api, request: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of one greedy request, streamed or not."""
    kw = dict(model=MODEL, temperature=0, **request)
    if not kw["stream"]:
        out = api.completions.create(**kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
    chunks = list(api.completions.create(**kw, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens


def test_concurrent_greedy_requests_return_what_each_returns_alone(model, tokenizer) -> None:
    """All 16 requests queue while the engine is held between steps, so one step admits them together: the batch
    is shared whatever the machine's speed (a sampled peak was not, on a loaded CI machine)."""
    requests = _mixed_requests(16, seed=3)
    with running_server(model, tokenizer, max_batch=16, prefill_chunk=16) as (engine, url):
        api = client(url)
        alone = [_complete(api, r) for r in requests]
        engine.reset_peaks()
        with ThreadPoolExecutor(16) as pool:
            with engine._state:  # the lock a step holds: the engine waits; submitting does not
                futures = [pool.submit(_complete, api, r) for r in requests]
                wait_for(lambda: engine.waiting() == 16, timeout=LIMIT_S, what="all 16 requests to queue")
            finished, _ = wait(futures, timeout=LIMIT_S)
        together = [f.result() for f in futures]
        peak = engine.stats()["running_peak"]
    assert len(finished) == 16
    assert peak == 16  # they really shared the engine
    for i, (want, got) in enumerate(zip(alone, together)):
        assert got == want, f"request {i} ({requests[i]['extra_body']}, {len(requests[i]['prompt'])} tokens)"
    assert all(tokens == r["max_tokens"] for (_, _, tokens), r in zip(alone, requests))


def test_load_64_requests_16_at_a_time_stays_within_kv_memory(model, tokenizer) -> None:
    from h2o_kv.runtime.engine import Engine

    kv_memory = 4 * Engine(model, tokenizer).kv_bytes_for(100, 11, policies.Full())
    requests = _mixed_requests(64, seed=5)
    with running_server(model, tokenizer, kv_memory=kv_memory, max_batch=16, prefill_chunk=32) as (engine, url):
        api = client(url)
        with Sampler(engine) as sampler, ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_complete, api, r) for r in requests]
            finished, _ = wait(futures, timeout=LIMIT_S)
        assert len(finished) == 64, f"{64 - len(finished)} requests unfinished after {LIMIT_S} s"
        results = [f.result() for f in futures]  # raises if any request failed
        stats = engine.stats()
    assert [tokens for _, _, tokens in results] == [r["max_tokens"] for r in requests]
    assert {finish for _, finish, _ in results} == {"length"}
    assert 0 < stats["kv_bytes_peak"] <= kv_memory  # the engine's own high-water mark, not a sample
    assert sampler.peak["kv_bytes_reserved"] <= kv_memory
    assert sampler.peak["waiting"] > 0 and stats["running_peak"] > 1  # memory, not count, admitted them
    assert stats["kv_bytes_in_use"] == 0 and stats["running"] == stats["waiting"] == 0


def _read_stream(url: str, body: dict, into: list) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        into.extend(line for line in response.iter_lines() if line)


def _release_when_draining(url: str, lock: threading.Lock) -> None:
    """Release `lock` once the server answers 503 (it drains), or after 10 s whatever it answers."""
    try:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, what="the drain")
    finally:
        lock.release()


def test_shutdown_drains_short_streams_and_ends_long_ones_cleanly(model, tokenizer) -> None:
    short, long = [], []
    body = {"model": MODEL, "prompt": "Hello", "temperature": 0, "stream": True}
    with running_server(model, tokenizer, drain_timeout=1.0) as (engine, url):
        threads = [
            threading.Thread(target=_read_stream, args=(url, body | {"max_tokens": 1000}, long)),
            threading.Thread(target=_read_stream, args=(url, body | {"max_tokens": 12}, short)),
        ]
        threads[0].start()
        wait_for(lambda: len(long) >= 2, what="the long stream to start")
        # The engine is held between steps until the server drains, so the short request is still queued when
        # the shutdown starts, however fast the machine (polling for both to run raced a 12-token request).
        engine._state.acquire()
        release = threading.Thread(target=_release_when_draining, args=(url, engine._state))
        try:
            threads[1].start()
            wait_for(lambda: engine.waiting() == 1, what="the short request to queue")
        finally:
            release.start()
    release.join(timeout=30)
    for thread in threads:  # the server is down: both streams must have ended on their own
        thread.join(timeout=30)
        assert not thread.is_alive()
    finish = [json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] for lines in (short, long)]
    assert finish == ["length", "cancelled"]
    assert short[-1] == long[-1] == "data: [DONE]"
    assert engine.stats()["running"] == 0


@pytest.mark.slow
def test_sigterm_ends_the_server_process_without_a_traceback(model, tokenizer, tmp_path) -> None:
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "h2o_kv.cli", "serve", "--model", str(tmp_path / "tiny"), "--served-model-name",
           MODEL, "--port", "0", "--drain-timeout", "1"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        for line in proc.stderr:  # uvicorn logs its address when it is up
            if "Uvicorn running on" in line:
                port = int(line.split("http://127.0.0.1:")[1].split()[0])
                break
        assert port, "the server did not start"
        lines: list[str] = []
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "stream": True}
        reader = threading.Thread(target=_read_stream, args=(f"http://127.0.0.1:{port}", body, lines))
        reader.start()
        wait_for(lambda: len(lines) >= 2, timeout=60, what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
        reader.join(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in (0, -signal.SIGTERM), rest  # uvicorn re-raises the signal after its clean shutdown
    assert "Finished server process" in rest and "Traceback" not in rest and "Error" not in rest, rest
    assert lines[-1] == "data: [DONE]"


@pytest.mark.slow
def test_a_study_stopped_by_sigterm_stops_the_server_it_started(model, tokenizer, tmp_path) -> None:
    """`launch_server`'s block ends on a SIGTERM to its process, so the server it started goes too (Python's default
    SIGTERM would end the study at once and leave the server running, holding its port)."""
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    script = (
        "import time\nfrom h2o_kv.runtime.serve.launch import launch_server\n"
        f"with launch_server({str(tmp_path / 'tiny')!r}, kv_memory=None, max_batch=2, prefill_chunk=16) as url:\n"
        "    print(url, flush=True)\n    time.sleep(120)\n"
    )
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/models", timeout=5)


def test_kv_memory_sizes_and_serve_flags() -> None:
    from h2o_kv.cli import build_parser
    from h2o_kv.runtime.serve.main import engine_settings

    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 GiB") == 3 * 2**29
    assert parse_bytes("123456") == 123456
    for bad in ("12XB", "-1", "", "0", "MiB", "1e9"):
        with pytest.raises(ValueError, match="kv-memory"):
            parse_bytes(bad)
    parse = build_parser().parse_args
    settings = engine_settings(parse(["serve", "--budget", "20%", "--kv-memory", "1GiB", "--max-batch", "8"]))
    assert (settings["policy"], settings["budget"], settings["kv_memory"], settings["max_batch"]) == (
        policies.SERVE_DEFAULT,
        0.2,
        2**30,
        8,
    )
    assert settings["kv_dtype"] is None
    assert engine_settings(parse(["serve", "--kv-dtype", "int8"]))["kv_dtype"] == "int8"
    with pytest.raises(ValueError, match="invalid choice"):  # the CLI prints it as one line, exit 2
        parse(["serve", "--kv-dtype", "int4"])
    assert engine_settings(parse(["serve", "--policy", "full"]))["budget"] is None
    assert engine_settings(parse(["serve", "--budget", "64"]))["budget"] == 64
    for argv in (["--budget", "1.5"], ["--budget", "0"], ["--max-batch", "0"], ["--kv-memory", "lots"]):
        with pytest.raises(ValueError):
            engine_settings(parse(["serve", *argv]))


def test_load_generator_at_a_tiny_size(model, tokenizer, tmp_path) -> None:
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.studies.loadgen import make_prompts, parse_configs, ratios, run_benchmark
    from h2o_kv.studies.serve_results import write_results

    with pytest.raises(ValueError):
        parse_configs("h2o:1.5")
    with pytest.raises(ValueError):
        parse_configs("full:64")
    configs = parse_configs("h2o:0.2, full")
    assert [c["fields"] for c in configs] == [
        {"kv_policy": "h2o", "kv_budget": "0.2", "ignore_eos": True},
        {"kv_policy": "full", "ignore_eos": True},
    ]
    prompts = make_prompts(list(range(5, 205)), n=6, length=96)
    assert [len(p) for p in prompts] == [96] * 6 and prompts[0] != prompts[1]

    kv_memory = 2 * Engine(model, tokenizer).kv_bytes_for(96, 6, policies.Full())
    with running_server(model, tokenizer, kv_memory=kv_memory, max_batch=16) as (engine, url):
        rows = run_benchmark(url, prompts, configs, max_tokens=6, concurrency=6, timeout=LIMIT_S, progress=str)
    assert [(r["config"], r["errors"], r["generated_tokens"]) for r in rows] == [("h2o:0.2", 0, 36), ("full", 0, 36)]
    for row in rows:
        assert 0 < row["ttft_s_p50"] <= row["latency_s_p50"] <= row["wall_s"]
        assert row["kv_bytes_allowed"] == kv_memory and 0 < row["peak_kv_bytes"] <= kv_memory
        assert 1 <= row["peak_running"] <= 6
    assert rows[1]["peak_running"] <= 2  # two full-cache requests fill the KV memory
    paths = write_results(rows, ratios(rows), {"requests": 6}, tmp_path)
    assert json.loads(paths["json"].read_text())["results"][0]["config"] == "h2o:0.2"
    assert paths["csv"].read_text().count("\n") == 3 and paths["plot"].stat().st_size > 0


def test_load_generator_refuses_kv_dtype_for_a_server_it_does_not_start(capsys) -> None:
    from h2o_kv.studies import loadgen

    assert loadgen.main(["--url", "http://127.0.0.1:9", "--kv-dtype", "int8", "--requests", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-dtype" in err[0] and "--url" in err[0]
    assert loadgen.main(["--url", "http://127.0.0.1:9", "--replicas", "2", "--requests", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replicas" in err[0] and "--url" in err[0]
    assert loadgen.main(["--replicas", "0", "--requests", "1"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_while_draining_new_requests_get_503_with_a_message(model, tokenizer) -> None:
    """After SIGTERM (the server's shutdown) the admitted stream goes on draining while a new request is answered
    503 with an OpenAI-shaped error saying why, not a refused connection."""
    long, refused = [], []
    body = {"model": MODEL, "prompt": "Hello", "temperature": 0, "stream": True, "max_tokens": 1000}

    def knock(url: str) -> None:  # the server still listens while it drains
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not refused:
            reply = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
            if reply.status_code == 503:
                refused.append(reply.json())
            time.sleep(0.02)

    with running_server(model, tokenizer, drain_timeout=3.0) as (engine, url):
        streaming = threading.Thread(target=_read_stream, args=(url, body, long))
        streaming.start()
        wait_for(lambda: len(long) >= 2, what="the long stream to start")
        knocking = threading.Thread(target=knock, args=(url,))
        knocking.start()
    knocking.join(timeout=30)
    streaming.join(timeout=30)
    assert refused, "no request was answered 503 while the server drained"
    error = refused[0]["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert long[-1] == "data: [DONE]"

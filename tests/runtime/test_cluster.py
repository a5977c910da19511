"""`h2o-kv serve --replicas 2` on Ray Serve as a process, inside the test run on 127.0.0.1 (runtime/cluster): one
server (one private Ray) for the file, SIGTERMed by its last test. The OpenAI routes through the gateway
(completions, streaming), routing to the replica with the most free KV memory, session stickiness, a conversation's
next turn sent to the replica that kept its first (and reusing it), and a replica killed by its PID mid-load (its
conversation answered elsewhere, prefilled again). Which replica served what is read from the gateway's per-replica
metrics. A start on a Ray where Serve already runs is refused; SIGTERM drains the server and leaves no process of its
private Ray. Every load loop is bounded in count and time. The routing rule and the gateway without Ray:
tests/runtime/test_cluster_routing.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
import psutil  # noqa: E402

from h2o_kv.runtime.ports import free_port  # noqa: E402

from cluster_helpers import alive, carrying, cluster_server  # noqa: E402
from serve_helpers import MODEL, tiny_model, wait_for  # noqa: E402

# One worker runs this file (`make test`: --dist loadgroup), so one cluster serves its tests: under plain `load`
# each worker could start its own, two private Rays at once on a two-core machine.
pytestmark = pytest.mark.xdist_group("cluster")

# each replica: 400 kB of KV memory, 200 kB of it for finished requests' caches kept for reuse (a dozen)
ENGINE = ["--policy", "h2o", "--budget", "64", "--kv-memory", "400000", "--session-memory", "200000", "--max-batch",
          "4", "--prefill-chunk", "64"]  # fmt: skip
# A held stream must outlive its test: 1,500 tokens of the tiny model took 5 s on a quiet core, less than a busy
# machine's four requests through the gateway (its end then counted as a finish on the busy replica). At about 3 ms a
# token, this many take minutes; the test hangs up long before.
HOLD_TOKENS = 200_000
HOLD_SECONDS = 300  # at most, whatever the test does
CONTEXT = 262_144


def replicas(url: str) -> dict[str, dict[str, float]]:
    """{replica: {metric: value}} from the gateway's /metrics (the replicas' last reports)."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("h2o_kv_replica_"):
            name, _, value = line.rpartition(" ")
            metric, _, label = name.partition('{replica="')
            out.setdefault(label.rstrip('"}'), {})[metric.removeprefix("h2o_kv_replica_")] = float(value)
    return out


def gateway_metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in the gateway's metrics")


def finished(url: str) -> dict[str, float]:
    return {r: m["requests_finished"] for r, m in replicas(url).items()}


def _read_stream(url: str, body: dict, lines: list[str], hang_up: threading.Event | None = None) -> None:
    """Collect a stream's non-empty lines; hang up once `hang_up` is set."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
            if hang_up is not None and hang_up.is_set():
                return


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """The server, ready once both replicas report (one private Ray for the file: each costs a minute of both cores).
    The file's last test SIGTERMs it; where that test did not run, so does the fixture, leaving no process."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model(tokenizer, context=CONTEXT).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    flags = ["--served-model-name", MODEL, "--replicas", "2", *ENGINE, "--max-new-tokens", str(HOLD_TOKENS),
             "--drain-timeout", "120"]  # fmt: skip
    with cluster_server(folder, flags) as started:
        # the gateway's router starts with its first request; then both replicas report within a second
        assert httpx.get(f"{started.url}/health", timeout=60).status_code == 200
        wait_for(lambda: len(replicas(started.url)) == 2, timeout=60, what="both replicas reporting")
        yield started


@pytest.fixture(scope="module")
def cluster(server) -> str:
    """The shared server's base URL."""
    return server.url


def test_this_file_runs_on_one_worker(request):
    """`make test` (--dist loadgroup) sends the group to one worker by naming each test `<id>@cluster`; pytest 9.2
    drops that rename (pytest-xdist#1386) and spreads the tests over the workers without a word, where each worker
    starts its own cluster: two private Rays at once on two cores."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("one worker or none: not run under --dist loadgroup")
    assert request.node.nodeid.endswith("@cluster"), (
        f"pytest {pytest.__version__} loses --dist loadgroup's groups: install the pytest the dev extra pins"
    )


def client(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)


def test_completions_and_streams_through_the_gateway(cluster):
    api = client(cluster)
    reply = api.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    assert reply.usage.completion_tokens == 6 and reply.choices[0].text
    chunks = list(api.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text  # greedy: the same
    assert [m.id for m in api.models.list().data] == [MODEL]
    bad = httpx.post(f"{cluster}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the replica's own checks


def test_a_client_that_goes_away_frees_its_replica(cluster):
    """A stream closed by its client after two chunks: the gateway cancels the replica's call, the replica's app
    sees a disconnect and cancels the request long before its 3,500 tokens."""
    before = sum(m["generated_tokens"] for m in replicas(cluster).values())
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 3500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == ""
    wait_for(lambda: all(m["requests_running"] == 0 and m["kv_bytes_in_use"] == 0 for m in replicas(cluster).values()),
             timeout=30, what="the request cancelled on its replica")  # fmt: skip
    assert sum(m["generated_tokens"] for m in replicas(cluster).values()) - before < 3500


@contextlib.contextmanager
def _holding(url: str, user: str):
    """A long stream (ignore_eos) in a thread, so its replica holds a large KV reservation while the `with` block
    runs; then the client hangs up (the replica cancels it), also when the block fails, so a failed test leaves no
    stream running into the next. Its `HOLD_TOKENS` outlast the test, so its end is never counted as a finish while
    the test reads its replica's counts; it ends after `HOLD_SECONDS` whatever happens. Yields (the stream's
    future, the replica running it)."""
    api = client(url)
    deadline = time.monotonic() + HOLD_SECONDS
    stop = threading.Event()

    def run() -> int:
        chunks = 0
        with api.completions.create(model=MODEL, prompt="word " * 200, max_tokens=HOLD_TOKENS, temperature=0,
                                    stream=True, user=user, extra_body={"ignore_eos": True}) as stream:  # fmt: skip
            for _ in stream:
                chunks += 1
                if stop.is_set() or time.monotonic() > deadline:
                    break
        return chunks

    held = concurrent.futures.ThreadPoolExecutor(1).submit(run)
    try:
        yield held, _running_the_hold(url)
    finally:
        stop.set()
    assert held.result(timeout=120) > 0


def _running_the_hold(url: str) -> str:
    """The replica running the held stream: the one request running, on the same replica in reports at least a
    second apart, its generated tokens growing. One report is not enough: when Ray cannot reach a replica for a
    while, the gateway sends the request again elsewhere, and the first replica's last report still shows it."""
    first: dict = {}

    def settled() -> bool:
        stats = replicas(url)
        if sorted(m["requests_running"] for m in stats.values()) != [0, 1]:
            first.clear()
            return False
        (busy,) = [name for name, m in stats.items() if m["requests_running"] == 1]
        if first.get("replica") != busy:
            first.update(replica=busy, at=time.monotonic(), tokens=stats[busy]["generated_tokens"])
            return False
        return time.monotonic() - first["at"] >= 1 and stats[busy]["generated_tokens"] > first["tokens"]

    wait_for(settled, timeout=60, what="the long request running on one replica")
    return first["replica"]


def _wait_finished(url: str, done, what: str, before: dict[str, float], busy: str, free: str) -> None:
    """wait_for on the replicas' finished counts; a timeout names each replica's counts (reported now and before), so
    a failure says whether the requests went to the wrong replica (routing) or were not reported (reporting)."""
    try:
        wait_for(lambda: done(finished(url)), timeout=30, what=what)
    except AssertionError as err:
        now = replicas(url)
        counts = {name: {"role": "busy" if name == busy else "free" if name == free else "?",
                         "finished_before": before.get(name), **stats} for name, stats in now.items()}  # fmt: skip
        raise AssertionError(f"{err}; each replica's last report: {counts}") from None


def _running(url: str) -> list[float]:
    return sorted(m["requests_running"] for m in replicas(url).values())


def test_requests_go_to_the_replica_with_room_and_sessions_stick(cluster):
    api = client(cluster)
    # an earlier test's request may still be ending on a replica (its reservation would pass for alice's)
    wait_for(lambda: _running(cluster) == [0, 0], timeout=60, what="the replicas idle before the test")
    with _holding(cluster, "alice") as (held, busy):
        (free,) = set(replicas(cluster)) - {busy}
        before = finished(cluster)
        for i in range(4):  # other conversations: the replica with room
            api.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=3, user=f"bob{i}")
        _wait_finished(
            cluster, lambda now: now[free] == before[free] + 4, "the reports of the 4 requests", before, busy, free
        )
        assert not held.done(), "alice's stream ended: the busy replica's counts no longer tell where requests went"
        assert finished(cluster)[busy] == before[busy]
        api.completions.create(model=MODEL, prompt="Again", max_tokens=3, user="alice")  # her replica, though full
        _wait_finished(cluster, lambda now: now[busy] == before[busy] + 1, "alice's request on her replica", before,
                       busy, free)  # fmt: skip
        assert finished(cluster)[free] == before[free] + 4


def _chat(url: str, messages: list[dict], **extra):
    """One chat turn of one token, greedy (the kept cache then has seen exactly the turn's prompt)."""
    return client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, **extra)


def _turns(tokenizer, first: str) -> tuple[list[dict], list[dict], list[int]]:
    """A conversation's first turn, its second (the first, an answer and a question) and the first's prompt ids
    as the replicas compute them; the second's ids extend them (checked), so a replica keeping the first reuses it."""
    turn1 = [{"role": "user", "content": first}]
    turn2 = turn1 + [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Tell me a story."}]
    ids1, ids2 = (tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"] for m in (turn1, turn2))  # fmt: skip
    assert ids2[: len(ids1)] == ids1 and len(ids2) > len(ids1)
    return turn1, turn2, ids1


def test_a_conversations_next_turn_goes_to_the_replica_that_kept_its_first(cluster, tokenizer):
    """Turn 1 of a chat leaves its cache kept on its replica, which then also runs a long stream (the same session,
    so sticky), so it has less room than the other; turn 2, with no session id, still goes there by the fingerprints
    of what it keeps, and prefills only what follows turn 1's prompt."""
    turn1, turn2, ids1 = _turns(tokenizer, "Hello there, how are you today?")
    wait_for(lambda: _running(cluster) == [0, 0], timeout=60, what="the replicas idle before the test")
    assert _chat(cluster, turn1, user="conv").usage.prompt_tokens == len(ids1)
    with _holding(cluster, "conv") as (held, holder):
        hits = {name: m["prefix_hits"] for name, m in replicas(cluster).items()}
        reply = _chat(cluster, turn2)
        assert reply.usage.prompt_tokens_details.cached_tokens == len(ids1), reply.usage
        wait_for(lambda: replicas(cluster)[holder]["prefix_hits"] == hits[holder] + 1, timeout=30,
                 what="the prefix hit reported by turn 1's replica")  # fmt: skip
        assert {name: m["prefix_hits"] for name, m in replicas(cluster).items() if name != holder} == {
            name: count for name, count in hits.items() if name != holder}  # fmt: skip


def test_a_killed_replica_fails_only_its_requests_and_comes_back(cluster, tokenizer):
    """Mid-load, the replica that kept a conversation's first turn is killed: every request ends (completions
    retried elsewhere, streams already started end with an error event), the conversation's next turn is prefilled
    again and answered, and Ray Serve starts the replica again. After the kill one replica serves all 8 requests
    while the new process loads torch, so a request may take minutes on a busy machine."""
    api = client(cluster, timeout=180)
    turn1, turn2, ids1 = _turns(tokenizer, "What is a KV cache, in one line?")
    wait_for(lambda: _running(cluster) == [0, 0], timeout=60, what="the replicas idle before the test")
    before = finished(cluster)
    _chat(cluster, turn1)
    wait_for(lambda: sum(finished(cluster).values()) == sum(before.values()) + 1, timeout=30, what="turn 1 reported")
    (holder,) = [name for name, count in finished(cluster).items() if count == before[name] + 1]

    def complete(i: int) -> str:
        return api.completions.create(model=MODEL, prompt=f"Load {i}", max_tokens=200, user=f"u{i}",
                                      extra_body={"ignore_eos": True}).choices[0].finish_reason  # fmt: skip

    def stream(i: int) -> str:
        events = list(api.completions.create(model=MODEL, prompt=f"Stream {i}", max_tokens=400, stream=True,
                                             user=f"s{i}", extra_body={"ignore_eos": True}))  # fmt: skip
        return events[-1].choices[0].finish_reason if events and events[-1].choices else "error-event"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        jobs = [pool.submit(complete, i) for i in range(4)] + [pool.submit(stream, i) for i in range(4)]
        wait_for(lambda: replicas(cluster)[holder]["requests_running"] >= 1, timeout=30,
                 what="requests running on the replica keeping turn 1")  # fmt: skip
        victim = int(replicas(cluster)[holder]["process_id"])
        os.kill(victim, signal.SIGKILL)
        outcomes = []
        for job in jobs:
            try:
                outcomes.append(job.result(timeout=200))
            except openai.APIError as err:  # an OpenAI-shaped error (the stream's error event)
                outcomes.append(f"error: {err}")
        assert time.monotonic() - started < 240
    assert all(o in ("length", "error-event") or o.startswith("error: ") for o in outcomes), outcomes
    assert outcomes[:4] == ["length"] * 4, outcomes  # completions had received nothing: retried, all finished
    retried = gateway_metric(cluster, "h2o_kv_gateway_retries_total")
    broken = sum(o != "length" for o in outcomes)
    assert retried + broken >= 1, outcomes  # the kill hit requests in flight: retried or ended with an error
    assert gateway_metric(cluster, "h2o_kv_gateway_streams_broken_total") == broken
    again = _chat(cluster, turn2).usage  # its kept cache died with its replica: all of it prefilled elsewhere
    assert again.completion_tokens == 1 and again.prompt_tokens_details.cached_tokens == 0, again

    def restarted() -> bool:
        pids = [m.get("process_id") for m in replicas(cluster).values()]
        return len(pids) == 2 and None not in pids and victim not in pids

    wait_for(restarted, timeout=240, what="the replica restarted")  # a new process loads torch and the model
    assert client(cluster).completions.create(model=MODEL, prompt="After", max_tokens=3).usage.completion_tokens == 3


def test_a_start_where_serve_already_runs_is_refused(server, cluster, tmp_path):
    """`--ray-address` naming a Ray where Serve runs (the shared server's): one line, exit 2, and that Serve unharmed
    (Serve would keep its own HTTP options: this server would not listen on its --port)."""
    address = server.ray_address
    cmd = [sys.executable, "-m", "h2o_kv.cli", "serve", "--model", str(tmp_path), "--replicas", "2",
           "--ray-address", address, "--port", str(free_port())]  # fmt: skip
    # the server's Ray takes clients with its token (~/.ray/auth_token) only where they are told to send it
    env = os.environ | {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert last.startswith(f"h2o-kv: error: serve: Ray Serve already runs on the Ray cluster at {address}")
    assert "Traceback" not in done.stderr
    assert client(cluster).completions.create(model=MODEL, prompt="Still", max_tokens=3).usage.completion_tokens == 3


def test_sigterm_drains_the_cluster_server_and_leaves_no_process(server):
    """Last in the file: it stops the server the others share. SIGTERM while two streams run: it drains as the
    one-process server does (new requests 503 `shutting_down`, the short stream finishes with `data: [DONE]`; the
    drain ends when the client of the long one hangs up), prints no native stack dump, exits 0, and leaves no process
    of its private Ray (its processes recorded before SIGTERM, or any naming its temp dir) and no temp dir. Its start
    said nothing of attaching to an existing Serve app."""
    proc, out, url = server.proc, server.out, server.url
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("raylet" in p.name() for p in started) and os.path.isdir(server.temp_dir)
    wait_for(lambda: _running(url) == [0, 0], timeout=60, what="the replicas idle before the test")
    short: list[str] = []
    held: list[str] = []
    hang_up = threading.Event()
    body = {"model": MODEL, "prompt": "Hello", "stream": True, "ignore_eos": True}
    streams = [
        threading.Thread(target=_read_stream, args=(url, {**body, "max_tokens": 300}, short)),
        threading.Thread(target=_read_stream, args=(url, {**body, "max_tokens": 16000}, held, hang_up)),
    ]
    try:
        for thread in streams:
            thread.start()
        wait_for(lambda: len(short) >= 1 and len(held) >= 1, timeout=120, what="both streams started")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, timeout=120,
                 what="the server draining")  # fmt: skip
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        streams[0].join(timeout=120)
        assert short[-1] == "data: [DONE]", short[-3:]
        assert json.loads(short[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    finally:
        hang_up.set()  # the last request in flight goes: the drain ends
        streams[1].join(timeout=120)
    proc.wait(timeout=180)
    server.reader.join(timeout=30)  # its last lines
    log = "\n".join(out)
    assert proc.returncode == 0, log
    assert "SIGTERM received" not in log and "Traceback" not in log, log
    assert "Connecting to existing Serve app" not in log, log
    assert "h2o-kv serve: stopped" in out, log
    assert not [p for p in started if alive(p)], [(p.pid, p.name()) for p in started if alive(p)]
    assert not carrying(server.temp_dir) and not os.path.exists(server.temp_dir)

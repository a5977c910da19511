"""`h2o-kv serve`'s per-request bounds (`requests.Limits`, a flag each): a body over --max-body gets 413, a prompt
over --max-prompt-tokens and a max_tokens over --max-new-tokens 400 naming the field, a full queue 429 with
Retry-After; each refusal is counted in /metrics and leaves no KV bytes in use."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from h2o_kv.runtime.engine import Engine  # noqa: E402
from h2o_kv.runtime.serve.app import create_app  # noqa: E402
from h2o_kv.runtime.serve.requests import Limits  # noqa: E402
from h2o_kv.runtime.serve.server import serve_in_thread  # noqa: E402

from serve_helpers import MODEL, metric, wait_for  # noqa: E402

LIMITS = Limits(max_body_bytes=2048, max_prompt_tokens=40, max_new_tokens=900, max_queue=1)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    engine = Engine(model, tokenizer, max_batch=1)
    with serve_in_thread(create_app(engine, MODEL, limits=LIMITS), engine) as url:
        yield engine, url


def _post(url, **body):
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", **body}, timeout=60)


def test_the_limits_are_in_the_metrics(served):
    _, url = served
    for name, value in (("max_body_bytes", 2048), ("max_prompt_tokens", 40), ("max_new_tokens", 900), ("max_queue", 1)):
        assert metric(url, "h2o_kv_request_limit", {"limit": name}) == value
    context = served[0].context_limit  # prompt + max_tokens past it: 400 context_length_exceeded, whatever the policy
    assert metric(url, "h2o_kv_request_limit", {"limit": "context_tokens"}) == context > 0


def test_a_body_over_the_limit_gets_413(served):
    engine, url = served
    before = metric(url, "h2o_kv_requests_rejected_total", {"status": "413"})
    reply = _post(url, prompt="x" * 4000, max_tokens=2)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"
    assert metric(url, "h2o_kv_requests_rejected_total", {"status": "413"}) == before + 1
    assert engine.kv_bytes_in_use() == 0


def test_a_long_prompt_and_a_large_max_tokens_get_400_naming_the_field(served):
    _, url = served
    long = _post(url, prompt="word " * 200, max_tokens=2)
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    many = _post(url, max_tokens=901)
    assert many.status_code == 400 and many.json()["error"]["param"] == "max_tokens" and "cap of 900" in many.text
    assert _post(url, max_tokens=4, temperature=0).status_code == 200


def test_a_full_queue_gets_429_with_retry_after(served):
    """max_batch 1 and max_queue 1: one long request runs, one waits, the next is refused; then both clients hang
    up, which frees what they held."""
    engine, url = served
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    stop, started = threading.Event(), []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            started.append(response.status_code)
            for _ in response.iter_lines():
                if stop.is_set():
                    break  # leaving the block closes the connection: the server cancels the request

    threads = [threading.Thread(target=stream) for _ in range(2)]
    threads[0].start()
    wait_for(lambda: engine.stats()["running"] == 1, what="the first request to run")
    threads[1].start()
    wait_for(lambda: engine.stats()["waiting"] == 1, what="the second request to wait")
    refused = _post(url, max_tokens=2)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    assert started == [200, 200]
    wait_for(lambda: engine.stats()["running"] == engine.stats()["waiting"] == 0, what="the hung-up requests to end")
    assert engine.kv_bytes_in_use() == 0

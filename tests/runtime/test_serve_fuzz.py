"""A schema fuzzer against `h2o-kv serve` (schemathesis, from the server's own OpenAPI document), with and without
an API key: no 5xx, no response outside the documented schema, and no KV bytes left in use after the requests."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, response_schema_conformance  # noqa: E402

from h2o_kv.runtime.engine import Engine  # noqa: E402
from h2o_kv.runtime.serve.app import create_app  # noqa: E402
from h2o_kv.runtime.serve.requests import Limits  # noqa: E402
from h2o_kv.runtime.serve.server import serve_in_thread  # noqa: E402

from serve_helpers import MODEL, wait_for  # noqa: E402

KEY = "fuzz-key-0123"
LIMITS = Limits(max_body_bytes=4096, max_prompt_tokens=64, max_new_tokens=4, max_queue=8)  # every request is quick
EXAMPLES = 100  # per operation (fewer where the schema allows fewer distinct requests)


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
def test_no_request_gets_a_server_error(model, tokenizer, keyed):
    """Every operation of the server's OpenAPI document, `EXAMPLES` generated requests each (hypothesis, derandomized
    so a CI run is the same run), sent with the key when the server has one."""
    engine = Engine(model, tokenizer, max_batch=4)
    headers = {"Authorization": f"Bearer {KEY}"} if keyed else {}
    statuses: dict[int, int] = {}
    with serve_in_thread(create_app(engine, MODEL, api_keys=(KEY,) if keyed else (), limits=LIMITS), engine) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                      database=None)  # fmt: skip
            @given(operation.as_strategy())
            def send(case) -> None:
                if isinstance(case.body, dict) and "model" in case.body:  # past the model check, into the engine
                    case.body["model"] = MODEL
                response = case.call(base_url=url, headers=headers, timeout=30)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=(not_a_server_error, response_schema_conformance))

            send()
        wait_for(lambda: engine.stats()["running"] == engine.stats()["waiting"] == 0, what="the requests to end")
        assert engine.kv_bytes_in_use() == 0
    tried = sum(statuses.values())
    print(f"\nfuzz ({'keyed' if keyed else 'open'}): {tried} requests, statuses {dict(sorted(statuses.items()))}")
    assert tried >= 200 and statuses.get(200, 0) > 0 and statuses.get(400, 0) + statuses.get(422, 0) > 0

"""Schema fuzzing: schemathesis drives a live `novainfer serve` (tiny model) from its own /openapi.json.

Every generated request, valid or not, must get no 5xx, a documented status and content type, a body that
matches the documented schema, an OpenAI error object with every 4xx, and a well-formed SSE stream (JSON
chunks, no error chunk, then `[DONE]`) when it streams. `make test` runs the bounded Hypothesis profile
(tests/conftest.py), `make fuzz` the long one (`--hypothesis-profile=fuzz`).
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_utils import RemoteServer

MODEL = "tiny"
STATUSES: Counter = Counter()  # (operation, status) of every request sent, for the summary line


def openai_error_object(ctx, response, case) -> bool | None:
    """Every 4xx/5xx body is {"error": {message, type, param, code, request_id}} naming this response's id
    (Anthropic's {"type": "error", "error": {type, message}, "request_id"} on /v1/messages)."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    if case.path.startswith("/v1/messages"):
        assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", f"not Anthropic's: {body!r}"
        assert body["error"]["message"] and body["error"]["type"], f"error without a message or type: {body!r}"
        assert body["request_id"] == response.headers.get("x-request-id", [None])[0], "request_id is not X-Request-Id"
        return None
    assert set(body) == {"error"}, f"not an OpenAI error object: {body!r}"
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], f"error without a message: {body!r}"
    assert isinstance(err.get("type"), str) and err["type"], f"error without a type: {body!r}"
    assert {"param", "code", "request_id"} <= set(err), f"error misses param/code/request_id: {body!r}"
    assert err["request_id"] == response.headers.get("x-request-id", [None])[0], "request_id is not X-Request-Id"
    return None


def well_formed_stream(ctx, response, case) -> bool | None:
    """An SSE answer is `data: <json>` events without an error chunk, ending with `data: [DONE]`; the Responses
    and Messages APIs' named events end with their last event."""
    if response.status_code != 200 or "text/event-stream" not in response.headers.get("content-type", [""])[0]:
        return None
    assert not response.stream_cut_short, "the stream did not end within the request timeout"
    events = [e for e in response.content.decode().split("\n\n") if e]
    if case.path in NAMED_EVENTS:
        names = [e.split("\n", 1)[0][len("event: ") :] for e in events]
        assert all(e.startswith("event: ") for e in events) and names[-1] in NAMED_EVENTS[case.path], names[-3:]
        assert "error" not in names, f"the stream carried an error: {events[-1]!r}"
        return None
    assert events and events[-1] == "data: [DONE]", f"the stream does not end with [DONE]: {events[-1:]!r}"
    for event in events[:-1]:
        assert event.startswith("data: "), f"not an SSE data event: {event!r}"
        chunk = json.loads(event[len("data: ") :])
        assert "error" not in chunk, f"the stream carried an error: {chunk!r}"
        assert chunk["object"] in ("chat.completion.chunk", "text_completion") and chunk["model"] == MODEL
    return None


NAMED_EVENTS = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    openai_error_object,
    well_formed_stream,
]


@pytest.fixture(scope="module")
def fuzz_server(tiny_qwen2, tmp_path_factory):
    """A short context (128 tokens) keeps every accepted request fast, so many cases fit in the budget."""
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, "--max-model-len", "128"],
        str(tmp_path_factory.mktemp("fuzz") / "server.log"),
    )
    yield srv
    by_status = Counter()
    for (_, status), count in STATUSES.items():
        by_status[status] += count
    print(
        f"\nschema fuzzing: {sum(STATUSES.values())} requests, by status {dict(sorted(by_status.items()))}; "
        f"server log {srv.log_path}"
    )
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    # read whole streams (schemathesis stops at 20 events by default), so every one is checked up to [DONE]
    config = SchemathesisConfig.from_dict({"max-stream-events": 100_000})
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config)


def name_the_model(drawn: tuple) -> object:
    """Half the valid cases name the served model (a random name is a 404), so they reach generation."""
    case, served = drawn
    if served and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def fuzz_operation(operation) -> None:
    """Send valid and schema-violating cases of one operation (the loaded Hypothesis profile sets how many)."""
    valid = st.tuples(operation.as_strategy(GenerationMode.POSITIVE), st.booleans()).map(name_the_model)
    cases = st.one_of(valid, operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case) -> None:
        response = case.call_and_validate(checks=CHECKS, timeout=60)
        STATUSES[operation.label, response.status_code] += 1

    run()


# Every documented operation, one test each (so each has its own timeout and report line); the test below
# keeps this list equal to what /openapi.json documents.
OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "GET /v1/models",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /v1/responses/{response_id}/cancel",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/requests/{request_id}/cancel",
    "POST /tokenize",
    "POST /detokenize",
    "GET /health",
    "GET /ready",
    "GET /metrics",
    "GET /version",
]


def test_every_documented_operation_is_fuzzed(api_schema):
    assert sorted(result.ok().label for result in api_schema.get_all_operations()) == sorted(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_operation_conforms_to_its_schema(api_schema, label):
    method, path = label.split(" ", 1)
    fuzz_operation(api_schema[path][method])


# ---- regressions: each bug the fuzzing found, as a plain request ------------------------------------------
def post(server: RemoteServer, path: str, body: str, rid: str) -> httpx.Response:
    """POST a raw JSON body (so NaN and other non-standard literals go out as written)."""
    return httpx.post(
        server.url + path,
        content=body.encode(),
        timeout=30,
        headers={"content-type": "application/json", "X-Request-Id": rid},
    )


REFUSED = [  # (why, path, raw body, the param the error names)
    ("chat template of no messages raised: 500", "/tokenize", '{"messages": []}', "messages"),
    (
        "unbounded n: the request ran for minutes",
        "/v1/completions",
        '{"prompt": "hi", "n": 10077, "max_tokens": 4}',
        "n",
    ),
    (
        "NaN passed every range check and sampled garbage",
        "/v1/completions",
        '{"prompt": "hi", "temperature": NaN, "max_tokens": 3}',
        "temperature",
    ),
    (
        "NaN top_p",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN, "max_tokens": 3}',
        "top_p",
    ),
    (
        "Infinity presence_penalty",
        "/v1/completions",
        '{"prompt": "hi", "presence_penalty": -Infinity, "max_tokens": 3}',
        "presence_penalty",
    ),
    (
        "a boolean was taken as the number 0.0",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "min_p": false, "max_tokens": 3}',
        "min_p",
    ),
    ("a string was taken as a number", "/v1/completions", '{"prompt": "hi", "n": "2", "max_tokens": 3}', "n"),
    ("token ids are documented >= 0", "/detokenize", '{"tokens": [-1]}', "tokens.0"),
    ("param named pydantic's union member (prompt.constrained-str)", "/v1/completions", '{"prompt": []}', "prompt"),
]


@pytest.mark.parametrize("why,path,body,param", REFUSED, ids=[r[0] for r in REFUSED])
def test_found_bad_inputs_are_refused_with_400(fuzz_server, why, path, body, param):
    r = post(fuzz_server, path, body, "regression")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["request_id"] == "regression"
    assert r.elapsed.total_seconds() < 5


def test_405_says_which_methods_are_allowed(fuzz_server):
    r = httpx.request("TRACE", fuzz_server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_health_and_metrics_answer_as_documented(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()["paths"]
    health = httpx.get(fuzz_server.url + "/health", timeout=10)
    assert (
        health.status_code == 200
        and health.content == b""
        and "content" not in doc["/health"]["get"]["responses"]["200"]
    )
    metrics = httpx.get(fuzz_server.url + "/metrics", timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain")
    assert list(doc["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def test_unexpected_error_is_a_500_object_with_the_request_id(tiny_qwen2, monkeypatch):
    from fastapi.testclient import TestClient

    from novainfer.config import EngineConfig, ServerConfig
    from novainfer.server.api_server import build_app
    from novainfer.server.async_llm import AsyncLLM

    app = build_app(
        [("m", AsyncLLM(EngineConfig.from_kwargs(tiny_qwen2, device="cpu", cpu_kv_cache_tokens=256)))], ServerConfig()
    )

    def broken(name):
        raise RuntimeError("injected")

    monkeypatch.setattr(app.state.serving, "resolve_model", broken)
    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "boom-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "boom-1"
    assert r.json()["error"]["request_id"] == "boom-1" and "injected" in r.json()["error"]["message"]

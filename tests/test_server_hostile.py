"""Hostile input against a real `novainfer serve`: oversized and deeply nested bodies,
max_tokens past the model's room, paths outside the web files, CORS, and the API key."""

import socket
import time

import httpx
import pytest

from tests.server_utils import RemoteServer

MODEL = "tiny"
LIMIT = 1 << 20
KEY = "sk-S3cret-Key-never-logged"


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, "--max-request-body-bytes", str(LIMIT)],
        str(tmp_path_factory.mktemp("server") / "server.log"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def guarded(tiny_qwen2, tmp_path_factory):
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, "--api-key", KEY, "--allowed-origins", "http://good.example"],
        str(tmp_path_factory.mktemp("server") / "server.log"),
    )
    yield srv
    srv.stop()


def _is_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["request_id"] == resp.headers["x-request-id"]
    return error


def _still_serving(url: str) -> None:
    resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_body_over_the_limit_is_413_declared_or_chunked(server):
    big = b'{"model": "tiny", "prompt": "' + b"a" * LIMIT + b'"}'
    error = _is_openai_error(
        httpx.post(
            server.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"}, timeout=30
        ),
        413,
    )
    assert str(LIMIT) in error["message"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(LIMIT // 65536 + 2):
            yield b" " * 65536

    _is_openai_error(
        httpx.post(
            server.url + "/v1/chat/completions",
            content=chunks(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        ),
        413,
    )
    _still_serving(server.url)


@pytest.mark.parametrize("field", ["prompt", "user", "unknown_field"])
def test_deeply_nested_json_is_refused_cheaply(server, field):
    depth = 200_000  # 400 kB: under the size limit, far past any parser's recursion limit
    body = '{"model": "tiny", "%s": %s1%s}' % (field, "[" * depth, "]" * depth)
    t0 = time.monotonic()
    resp = httpx.post(
        server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert time.monotonic() - t0 < 2.0
    _is_openai_error(resp, 400)
    _still_serving(server.url)


def test_huge_prompt_and_max_tokens_past_the_models_room_are_400_naming_the_numbers(server):
    t0 = time.monotonic()
    error = _is_openai_error(
        httpx.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "hello " * 150_000}), 400
    )
    assert time.monotonic() - t0 < 10.0 and "maximum context length is 512" in error["message"]
    for max_tokens in (600, 10**12):
        error = _is_openai_error(
            httpx.post(
                server.url + "/v1/completions",
                timeout=30,
                json={"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens},
            ),
            400,
        )
        assert "512" in error["message"] and str(max_tokens) in error["message"] and error["param"] == "max_tokens"
    error = _is_openai_error(
        httpx.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "Hi", "max_tokens": -1}),
        400,
    )
    assert "max_tokens" in error["message"]


def test_one_request_cannot_ask_for_unbounded_work(server):
    """n is capped per prompt, and prompts x n per request (one admission slot holds them all)."""
    error = _is_openai_error(
        httpx.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": ["Hi"] * 100, "n": 128}),
        400,
    )
    assert "12800 sequences" in error["message"] and error["param"] == "n"
    _is_openai_error(
        httpx.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "Hi", "n": 129}), 400
    )


def _raw_get(port: int, path: str) -> tuple[int, bytes]:
    """GET with the path sent byte for byte (clients normalise `..` away)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize(
    "path",
    [
        "/../pyproject.toml",
        "/../../novainfer/config.py",
        "/%2e%2e/%2e%2e/novainfer/config.py",
        "/webui/../config.py",
        "/webui/..%2f..%2fnovainfer%2fconfig.py",
        "/webui/%2e%2e/%2e%2e/pyproject.toml",
        "/webui/....//....//pyproject.toml",
        "/webui//etc/passwd",
        "/webui/%2fetc%2fpasswd",
        "/webui/app.js/../../config.py",
        "/static/../config.py",
        "/index.html/../../config.py",
    ],
)
def test_web_files_cannot_reach_other_paths(server, path):
    status, body = _raw_get(server.port, path)
    assert b"class ServerConfig" not in body and b"[build-system]" not in body and b"root:" not in body
    assert status in (400, 404), (status, body[:200])


def test_cors_is_off_by_default(server):
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    got = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def test_cors_allows_only_the_given_origins(guarded):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            guarded.url + "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )

    ok = preflight("http://good.example")
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://good.example"
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers
    denied = httpx.get(guarded.url + "/v1/models", headers={"Origin": "http://good.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://good.example"


def test_api_key_is_checked_and_never_logged(guarded):
    url = guarded.url + "/v1/models"
    for wrong in ("", "Bearer x", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", KEY, f"bearer {KEY}"):
        headers = {"Authorization": wrong} if wrong else {}
        assert _is_openai_error(httpx.get(url, headers=headers), 401)["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200  # open paths stay open
    bad = httpx.post(
        guarded.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": -5},
    )
    assert bad.status_code == 400
    assert KEY not in guarded.log() and KEY[3:-3] not in guarded.log()

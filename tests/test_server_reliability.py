"""Reliability findings of 2026-11-27 against a real `novainfer serve`: duplicate X-Request-Id, client chat
templates, stalled SSE readers, bounds on client-controlled state, slowloris, and small input checks."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tests.server_utils import RemoteServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    srv = RemoteServer(
        [
            tiny_qwen2,
            "--served-model-name",
            MODEL,
            "--max-concurrent-requests",
            "2",
            "--max-queue-len",
            "0",
            "--stream-write-timeout",
            "2",
            "--max-sessions",
            "1",
            "--request-header-timeout",
            "2",
            "--keep-alive-timeout",
            "6",
        ],
        str(tmp_path_factory.mktemp("server") / "server.log"),
    )
    yield srv
    srv.stop()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:500]
    return resp.json()["error"]


def _sse(lines) -> list:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def _complete(url: str, max_tokens: int = 4, **extra) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, **extra}
    )


# ---- 1. a reused X-Request-Id -------------------------------------------------------------------------------
def test_duplicate_request_id_is_409_and_the_first_request_is_untouched(server):
    url = server.url
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": "dup"}) as first,
    ):
        lines = first.iter_lines()
        assert "choices" in next(line for line in lines if line.startswith("data: "))
        for headers in ({"X-Request-Id": "dup"},):
            second = httpx.post(
                url + "/v1/completions",
                headers=headers,
                timeout=30,
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
            )
            error = _error(second, 409)
            assert "dup" in error["message"] and second.headers["x-request-id"] == "dup"
        events = _sse(lines)
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert server.wait_idle() == 0


def test_duplicate_of_a_non_streaming_request_leaves_its_slot_to_come_back(server):
    """With every slot held by a request and its duplicate, the victims still finish and free their slots."""
    url, results = server.url, {}

    def run(name: str, rid: str, max_tokens: int) -> None:
        results[name] = httpx.post(
            url + "/v1/completions",
            headers={"X-Request-Id": rid},
            timeout=60,
            json={"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True},
        )

    threads = [
        threading.Thread(target=run, args=("a", "same", 500)),
        threading.Thread(target=run, args=("b", "other", 500)),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20  # both admitted and running: the duplicate then meets a live "same"
    while (
        time.monotonic() < deadline
        and 'novainfer:num_requests_running{model_name="tiny"} 2.0' not in httpx.get(url + "/metrics", timeout=10).text
    ):
        time.sleep(0.01)
    dup = httpx.post(
        url + "/v1/completions",
        headers={"X-Request-Id": "same"},
        timeout=30,
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    )
    for t in threads:
        t.join()
    assert dup.status_code == 409
    assert results["a"].status_code == 200 and results["a"].json()["usage"]["completion_tokens"] == 500
    assert server.wait_idle() == 0
    # both slots came back: two at once are admitted without a 429
    assert [r.status_code for r in _parallel(url, 2)] == [200, 200]


def _parallel(url: str, k: int, timeout: float = 30) -> list[httpx.Response]:
    out: list = [None] * k

    def one(i: int) -> None:
        try:
            out[i] = httpx.post(
                url + "/v1/completions", timeout=timeout, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            )
        except httpx.TimeoutException as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ---- 2. client-supplied chat templates ---------------------------------------------------------------------
LOOP_TEMPLATE = "{% for i in range(3000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"


def _chat(url: str, **extra) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra},
    )


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"chat_template": "{{ 'a ' * 5000000 }}"}, "chat_template"),
        ({"chat_template": LOOP_TEMPLATE}, "chat_template"),
        ({"tokenize": False}, "tokenize"),
    ],
)
def test_client_chat_template_is_refused_by_default(server, kwargs, param):
    t0 = time.monotonic()
    error = _error(_chat(server.url, chat_template_kwargs=kwargs), 400)
    assert time.monotonic() - t0 < 1.0
    assert error["param"] == f"chat_template_kwargs.{param}" and param in error["message"]
    assert _error(_chat(server.url, chat_template=LOOP_TEMPLATE), 400)["param"] == "chat_template"


@pytest.fixture(scope="module")
def trusting(tiny_qwen2, tmp_path_factory):
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, "--trust-request-chat-template"],
        str(tmp_path_factory.mktemp("server") / "server.log"),
    )
    yield srv
    srv.stop()


def test_trusted_client_template_renders_off_the_event_loop(trusting):
    """A slow template (3 * 10^7 loop steps) runs while /health and other requests keep answering."""
    url, slow = trusting.url, {}

    def run() -> None:
        slow["resp"] = _chat(url, chat_template_kwargs={"chat_template": LOOP_TEMPLATE})

    thread = threading.Thread(target=run)
    t0 = time.monotonic()
    thread.start()
    time.sleep(0.2)
    worst, probes = 0.0, 0
    while thread.is_alive():
        t1 = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        worst, probes = max(worst, time.monotonic() - t1), probes + 1
        time.sleep(0.05)
    thread.join()
    assert slow["resp"].status_code == 200, slow["resp"].text
    assert slow["resp"].json()["usage"]["prompt_tokens"] == len(
        httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hi", "add_special_tokens": False}).json()[
            "tokens"
        ]
    )
    # a template on the event loop made the first probe wait for all of it; the bound is relative to the render
    # time, which depends on the machine (0.9-1.6 s seen)
    took = time.monotonic() - t0
    assert probes >= 4 and worst < min(1.5, took / 3), (took, worst, probes)


# ---- 3. an SSE client that stops reading -------------------------------------------------------------------
def test_stalled_sse_reader_is_dropped_and_its_slot_freed(server):
    """A client that sends a large streaming request and never reads is cut off after --stream-write-timeout;
    a concurrent request completes meanwhile, and both admission slots are free afterwards."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "n": 16,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", server.port))
    stalled.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        t0 = time.monotonic()
        assert _complete(server.url, 4).status_code == 200
        assert time.monotonic() - t0 < 5.0
        server.wait_idle(timeout=30)  # the engine is done with it (about 11 MB of events: past any socket buffer)
        time.sleep(3)  # the write timeout is 2 s
        t0 = time.monotonic()
        codes = [getattr(r, "status_code", r) for r in _parallel(server.url, 2, timeout=10)]
        assert codes == [200, 200] and time.monotonic() - t0 < 5.0
        assert server.wait_idle() == 0
        assert "stream-write-timeout" in server.log()
    finally:
        stalled.close()


# ---- 5. engine supervision ---------------------------------------------------------------------------------
def _core_pid(srv: RemoteServer) -> int:
    import re

    return int(re.search(r"engine core process pid=(\d+) started", srv.log()).group(1))


def _alive(pid: int) -> bool:
    """Whether pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stream_in_flight(url: str, out: dict) -> threading.Thread:
    """A long stream in a thread; out["events"] gets its SSE data lines."""

    def run() -> None:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                out["events"] = _sse(resp.iter_lines())
        except httpx.HTTPError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_core_killed_fails_in_flight_requests_and_the_server_exits_non_zero(tiny_qwen2, tmp_path_factory):
    import os
    import signal

    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, "--max-num-seqs", "1"],
        str(tmp_path_factory.mktemp("server") / "server.log"),
    )
    try:
        pid, out = _core_pid(srv), {}
        thread = _stream_in_flight(srv.url, out)
        deadline = time.monotonic() + 10
        while srv.metric("novainfer:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert srv.proc.wait(timeout=15) != 0  # exits by itself, for a supervisor to restart it
        events = out["events"]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
        assert "killed by signal SIGKILL (-9)" in json.loads(events[-2])["error"]["message"]
        assert not _alive(pid)  # reaped: no zombie left
        assert "exit status could not be read" not in srv.log()
    finally:
        srv.stop()


def test_frozen_core_turns_health_503_within_the_step_timeout(tiny_qwen2, tmp_path_factory):
    import os
    import signal

    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, "--engine-step-timeout", "3"],
        str(tmp_path_factory.mktemp("server") / "server.log"),
    )
    pid = _core_pid(srv)
    try:
        assert _complete(srv.url).status_code == 200
        os.kill(pid, signal.SIGSTOP)
        out = {}
        thread = _stream_in_flight(srv.url, out)
        t0, health = time.monotonic(), 200
        while health == 200 and time.monotonic() - t0 < 10:
            time.sleep(0.2)
            try:
                health = httpx.get(srv.url + "/health", timeout=5).status_code
            except httpx.HTTPError:  # the server already exited
                health = None
        assert health in (503, None) and 2.5 < time.monotonic() - t0 < 6.0
        thread.join(30)
        events = out["events"]
        assert events[-1] == "[DONE]" and "no step progress" in json.loads(events[-2])["error"]["message"]
        assert srv.proc.wait(timeout=15) != 0
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        srv.stop()


# ---- 4. bounds on client-controlled state ------------------------------------------------------------------
def test_session_id_is_bounded_and_a_refused_request_makes_no_session(server):
    error = _error(_complete(server.url, session_id="s" * 257), 400)
    assert error["param"] == "session_id" and "256" in error["message"]
    first = _complete(server.url, 4, session_id="kept")  # the server keeps one session (--max-sessions 1)
    assert first.status_code == 200
    assert _complete(server.url, 10**6, session_id="refused").status_code == 400  # must not evict "kept"
    again = _complete(server.url, 4, session_id="kept")
    history = first.json()["usage"]["prompt_tokens"] + first.json()["usage"]["completion_tokens"]
    assert again.json()["usage"]["prompt_tokens"] > history


@pytest.mark.parametrize(
    "extra, param, limit",
    [
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "64"),
        ({"stop": ["x" * 1025]}, "stop", "1024"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "1024"),
    ],
)
def test_stop_lists_are_bounded(server, extra, param, limit):
    error = _error(_complete(server.url, **extra), 400)
    assert error["param"].startswith(param) and limit in error["message"]


def test_message_count_is_bounded(server):
    messages = [{"role": "user", "content": "a"}] * 1025
    resp = httpx.post(
        server.url + "/v1/chat/completions", timeout=30, json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    error = _error(resp, 400)
    assert error["param"] == "messages" and "1024" in error["message"]


def test_logprob_work_is_bounded(server):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "n": 128,
            "max_tokens": 450,
            "logprobs": True,
            "top_logprobs": 20,
        },
    )
    error = _error(resp, 400)
    assert error["param"] == "top_logprobs" and "1048576" in error["message"]


def test_connections_that_never_finish_their_headers_are_closed(server):
    """Slowloris: partial request heads, trickled a byte at a time, are cut off by --request-header-timeout."""
    socks = []
    heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"] * 4
    heads += [HEALTH, HEALTH + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"]  # after a response; pipelined
    for head in heads:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(head)
        s.settimeout(0.2)
        socks.append(s)
    t0, closed = time.monotonic(), set()
    while len(closed) < len(socks) and time.monotonic() - t0 < 8:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"X")  # never a whole header line
                if s.recv(1024) == b"":
                    closed.add(i)
            except socket.timeout:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.3)
    for s in socks:
        s.close()
    assert len(closed) == len(socks) and time.monotonic() - t0 < 6
    assert _complete(server.url).status_code == 200


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def _read_response(s: socket.socket) -> bytes:
    """One whole (Content-Length) response from a raw socket."""

    def more() -> bytes:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length")
    )
    while len(body) < length:
        body += more()
    return head


def test_an_idle_keep_alive_connection_serves_until_the_keep_alive_timeout(server):
    """A client may come back on a pooled connection later than --request-header-timeout (2 s here): only
    --keep-alive-timeout (6 s) closes a silent one, and cleanly, so no client reuses a connection being closed."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(20)
        s.sendall(HEALTH)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(3)
        s.sendall(HEALTH)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        idle = time.monotonic()
        assert s.recv(1) == b""  # closed by the server: end of stream, not a reset
        assert 5 < time.monotonic() - idle < 12


# ---- 6. smaller checks -------------------------------------------------------------------------------------
def test_pathological_regex_is_400(server):
    t0 = time.monotonic()
    error = _error(_complete(server.url, structured_outputs={"regex": "(x{1000}){1000}"}), 400)
    assert "1000000" in error["message"] and "100000" in error["message"] and time.monotonic() - t0 < 1.0
    assert _complete(server.url, structured_outputs={"regex": "(ab){1,3}"}).status_code == 200


def test_template_kwargs_that_change_the_result_type_are_400(server):
    error = _error(_chat(server.url, chat_template_kwargs={"return_tensors": "np"}), 400)
    assert error["param"] == "chat_template_kwargs.return_tensors"


def test_stop_token_ids_outside_the_vocabulary_are_400(server):
    error = _error(_complete(server.url, stop_token_ids=[5, 10**6]), 400)
    assert error["param"] == "stop_token_ids" and str(10**6) in error["message"]


def test_metrics_name_the_served_model_not_its_path(server, tiny_qwen2):
    assert _complete(server.url).status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'model_name="tiny"' in text and tiny_qwen2 not in text


def test_a_second_authorization_header_is_400(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        timeout=30,
        headers=[("Authorization", "Bearer a"), ("Authorization", "Bearer b")],
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    )
    error = _error(resp, 400)
    assert "Authorization" in error["message"]


def test_ipc_directory_of_a_killed_front_end_is_removed_at_the_next_start(tiny_qwen2, tmp_path_factory):
    import os
    import re
    import signal

    logs = tmp_path_factory.mktemp("server")
    killed = RemoteServer([tiny_qwen2], str(logs / "killed.log"))
    directory = os.path.dirname(re.search(r"input ipc://(\S+)/input", killed.log()).group(1) + "/input")
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(10)
    killed.stop()
    assert os.path.isdir(directory)  # nobody was left to remove it
    time.sleep(1.5)  # its core notices the front-end is gone (it polls every 0.5 s) and exits
    again = RemoteServer([tiny_qwen2], str(logs / "again.log"))
    try:
        assert not os.path.exists(directory)
    finally:
        again.stop()


class _Untouchable:
    """A tokenizer and engine that fail the test if a refused request reaches them; only the front-end's own table of
    running ids may be read (in_use: the duplicate id's 409 comes before the 429)."""

    def in_use(self, request_id: str) -> bool:
        return False

    def __getattr__(self, name):
        raise AssertionError(f"a request refused for capacity touched {name!r} (tokenizing, rendering or the engine)")


def test_burst_refusal_comes_before_any_template_or_tokenization_work():
    """Issue 35 item 8: with every slot and queue place taken, a chat or completion request is refused (429 with
    Retry-After) before its prompt is rendered or tokenized, and without waiting on the engine: the tokenizer and
    engine here raise if touched. (benchmarks/burst_429.py times it; wall times are not asserted on this machine.)"""
    from novainfer.server.errors import APIError
    from novainfer.server.limits import AdmissionLimiter
    from novainfer.server.protocol import ChatCompletionRequest, CompletionRequest
    from novainfer.server.serving import OpenAIServing, ServedModel
    from novainfer.server.serving_completions import CompletionHandler
    from novainfer.server.sessions import SessionStore

    async def run() -> list[APIError]:
        limiter = AdmissionLimiter(max_concurrent=1, max_queue_len=0)
        slot = await limiter.acquire()  # the one slot is busy; no queue
        model = ServedModel("m", "/nowhere", _Untouchable(), _Untouchable(), 64)
        handler = CompletionHandler(OpenAIServing([model], limiter, SessionStore()))
        errors = []
        chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi " * 1000}]})
        completion = CompletionRequest.model_validate({"prompt": "hi " * 1000})
        for call in (handler.chat(chat, "r1", None), handler.completion(completion, "r2", None)):
            with pytest.raises(APIError) as info:
                await call
            errors.append(info.value)
        slot.release()
        return errors

    for err in asyncio.run(run()):
        assert err.status == 429 and err.headers["Retry-After"] == "1", err

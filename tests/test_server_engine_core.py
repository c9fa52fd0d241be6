"""The engine core in its own process, against a real `novainfer serve` with a tiny model.

The core is a child process of the server (one per --model); its death is seen at once (503s, streams end
with an error chunk and [DONE]); it leaves by itself when the server dies; garbage on either socket is
logged and dropped. References for text are the offline LLM's greedy answers on the same checkpoint.
"""

import json
import os
import re
import signal
import time

import httpx
import msgspec
import psutil
import pytest
import zmq

from novainfer import LLM, SamplingParams
from tests.server_utils import RemoteServer
from tests.tiny_models import make_tiny_model

PROMPT = "The cat sat on"
_CORE_LINE = re.compile(r"engine core process pid=(\d+) started \(input (\S+), output (\S+)\)")


def _server(tmp_path_factory, *args: str) -> RemoteServer:
    return RemoteServer(list(args), str(tmp_path_factory.mktemp("engine_core") / "server.log"))


def _cores(srv: RemoteServer) -> list[tuple[int, str, str]]:
    """(pid, input address, output address) of each engine core, in --model order, from the server's log."""
    return [(int(pid), inp, out) for pid, inp, out in _CORE_LINE.findall(srv.log())]


def _complete(srv: RemoteServer, model: str, max_tokens: int = 8, stream: bool = False, timeout: float = 30):
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=timeout)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def reference(tiny_qwen2) -> str:
    llm = LLM(tiny_qwen2, device="cpu")
    return (
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


@pytest.fixture(scope="module")
def two_models(tiny_qwen2, tmp_path_factory):
    srv = _server(tmp_path_factory, tiny_qwen2, "--model", tiny_qwen2, "--served-model-name", "a", "b")
    yield srv
    srv.stop()


def test_each_model_has_its_own_core_process(two_models, reference):
    cores = _cores(two_models)
    assert len(cores) == 2 and len({pid for pid, _, _ in cores}) == 2
    for pid, _, _ in cores:
        core = psutil.Process(pid)
        assert pid != two_models.proc.pid and core.ppid() == two_models.proc.pid and core.is_running()
    for model in ("a", "b"):
        assert _complete(two_models, model).json()["choices"][0]["text"] == reference
    chunks = [
        json.loads(line[6:])
        for line in _complete(two_models, "b", stream=True).text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference


def test_garbage_on_either_socket_is_dropped(two_models, reference):
    (pid, core_input, frontend_output), _ = _cores(two_models)
    ctx = zmq.Context()
    try:
        for address in (core_input, frontend_output):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            sock.send(b"\x00\xffnot msgpack at all")
            sock.send(msgspec.msgpack.encode(["add", ["garbage-1", "not token ids", {"n": -3}, 0.0]]))
            sock.send(msgspec.msgpack.encode(["outputs", [["garbage-2", "x"]], None, "now"]))
            sock.send(msgspec.msgpack.encode(["abort", [["garbage-3", None]]]))  # well formed, unknown id
            sock.close()
    finally:
        ctx.term()
    time.sleep(0.5)
    assert psutil.Process(pid).is_running()
    assert _complete(two_models, "a").json()["choices"][0]["text"] == reference
    log = two_models.log()
    assert "request_id=garbage-1 malformed message dropped" in log  # the core's side
    assert "malformed message from the engine core dropped" in log  # the front-end's side
    assert httpx.get(two_models.url + "/health").status_code == 200


def test_killed_core_fails_the_stream_at_once_and_the_server_exits_1(tiny_qwen2, tmp_path_factory):
    srv = _server(tmp_path_factory, tiny_qwen2, "--served-model-name", "tiny")
    try:
        ((pid, _, _),) = _cores(srv)
        with (
            httpx.Client(timeout=30) as http,
            http.stream(
                "POST",
                srv.url + "/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True},
            ) as in_flight,
        ):
            lines = in_flight.iter_lines()
            assert "choices" in next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
            ended = time.monotonic() - t0
        assert ended < 2.0 and rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == 503
        assert "engine core process" in json.loads(rest[-2])["error"]["message"]
        # then the server exits non-zero by itself, for its supervisor to restart it (docs/RELIABILITY.md 6.5)
        assert srv.proc.wait(timeout=15) == 1
    finally:
        srv.stop()


def test_core_leaves_when_the_server_dies(tiny_qwen2, tmp_path_factory):
    srv = _server(tmp_path_factory, tiny_qwen2, "--served-model-name", "tiny")
    ((pid, _, _),) = _cores(srv)
    try:
        assert _complete(srv, "tiny").status_code == 200
        srv.proc.kill()  # no chance to stop its core
        srv.proc.wait(5)
        assert _gone(pid, within=5.0), "the engine core outlived its server"
    finally:
        srv.stop()
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_tp_workers_are_the_cores_children_and_sigterm_stops_them(tmp_path_factory):
    """mp backend, tp 2, with the overlapped loop (the default on CUDA): the ranks are the core's children;
    SIGTERM stops the server, its core and the ranks."""
    model = make_tiny_model(
        str(tmp_path_factory.mktemp("qwen2_tp")), "qwen2", seed=5, num_heads=8, num_kv_heads=4, head_dim=8
    )
    srv = _server(
        tmp_path_factory,
        model,
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
        "--master-port",
        "0",
        "--async-scheduling",
    )
    ((pid, _, _),) = _cores(srv)
    try:
        assert _complete(srv, "tiny").status_code == 200 and "async_scheduling=True" in srv.log()
        ranks = [p for p in psutil.Process(pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(ranks) == 2  # the two ranks (spawning also starts a resource tracker, not counted)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0 and _gone(pid, within=1.0)
    assert all(_gone(p.pid, within=5.0) for p in ranks)

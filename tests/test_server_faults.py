"""Faults and shutdown, against a real `novainfer serve` subprocess.

Faults come from the test-only hook (tests/faults.py, in a server's engine core through tests/fault_server.py):
requests whose id starts with PREFIX fail at STAGE. References for text are the same server's answers to the
prompts alone.
"""

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from novainfer import SamplingParams
from novainfer.engine.llm_engine import LLMEngine
from novainfer.config import EngineConfig
from tests import faults
from tests.server_utils import FLOAT32, RemoteServer

MODEL = "tiny"
PROMPTS = ["The cat sat on", "Once upon a time", "Numbers: one two", "Hello, my name is"]


def _server(model: str, tmp_path_factory, *args: str, fault: str | None = None) -> RemoteServer:
    """A `novainfer serve` subprocess; fault: "STAGE:PREFIX" injected in its engine core."""
    return RemoteServer(
        [model, "--served-model-name", MODEL, *FLOAT32, *args],
        str(tmp_path_factory.mktemp("server") / "server.log"),
        **(dict(module="tests.fault_server", env={"NOVAINFER_TEST_FAULT": fault}) if fault else {}),
    )


def _complete(
    url: str, prompt: str, max_tokens: int, request_id: str | None = None, stream: bool = False
) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def _sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded ([DONE] kept as the string)."""
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [x if x == "[DONE]" else json.loads(x) for x in lines]


@pytest.mark.parametrize("stage", ["prepare", "postprocess"])
def test_engine_fails_only_the_faulty_request(tiny_qwen2, stage, monkeypatch):
    """In-process: the faulty request ends with finish_reason "error"; the others in its step, requeued
    (prepare) or carried on (postprocess), finish with the text they get alone."""
    faults.install(f"{stage}:bad-", monkeypatch.setattr)
    engine = LLMEngine(EngineConfig.from_kwargs(tiny_qwen2, device="cpu", dtype="float32"))  # see FLOAT32
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(requests: dict[str, str], after_steps: int = 0, late: dict[str, str] | None = None) -> dict:
        for rid, prompt in requests.items():
            engine.add_request(rid, prompt, params)
        for _ in range(after_steps):
            engine.step()
        for rid, prompt in (late or {}).items():
            engine.add_request(rid, prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    alone = {p: run({f"ref-{i}": p})[f"ref-{i}"].outputs[0].text for i, p in enumerate(PROMPTS[:3])}
    # two requests decode for two steps, then the bad one joins their batch
    outs = run({"ok-0": PROMPTS[0], "ok-1": PROMPTS[1]}, after_steps=2, late={"bad-2": PROMPTS[2]})
    assert outs["bad-2"].outputs[0].finish_reason == "error"
    assert f"fault injected at {stage}" in outs["bad-2"].error
    assert [outs[f"ok-{i}"].outputs[0].text for i in range(2)] == [alone[PROMPTS[0]], alone[PROMPTS[1]]]
    assert all(outs[f"ok-{i}"].error is None for i in range(2))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


@pytest.fixture(scope="module")
def faulty_server(tiny_qwen2, tmp_path_factory):
    srv = _server(tiny_qwen2, tmp_path_factory, fault="prepare:fault-")
    yield srv
    srv.stop()


def test_fault_in_a_batch_fails_that_request_alone(faulty_server):
    url = faulty_server.url
    alone = {p: _complete(url, p, 64).json()["choices"][0]["text"] for p in PROMPTS[:3]}

    async def scenario():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        started = [asyncio.Event() for _ in range(3)]
        finished_at: list[float] = [0.0] * 3

        async def good(i: int) -> str:
            text = ""
            stream = await client.completions.create(
                model=MODEL,
                prompt=PROMPTS[i],
                max_tokens=64,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                started[i].set()
            finished_at[i] = time.monotonic()
            return text

        async with httpx.AsyncClient(timeout=30) as http:  # made first: the bad request goes out the moment
            tasks = [asyncio.create_task(good(i)) for i in range(3)]  # all three are streaming
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            bad = await http.post(
                url + "/v1/completions",
                headers={"X-Request-Id": "fault-1"},
                json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 8},
            )
            failed_at = time.monotonic()
            bad_stream = await http.post(
                url + "/v1/completions",
                headers={"X-Request-Id": "fault-2"},
                json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 8, "stream": True},
            )
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return bad, bad_stream, texts, failed_at, finished_at

    bad, bad_stream, texts, failed_at, finished_at = asyncio.run(scenario())
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["request_id"] == "fault-1"
    assert "fault-1" in error["message"] and bad.headers["x-request-id"] == "fault-1"
    assert all(t > failed_at for t in finished_at), "the good requests had finished before the fault: no shared step"
    assert texts == [alone[p] for p in PROMPTS[:3]]
    events = _sse_events(bad_stream.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["request_id"] == "fault-2"
    assert events[-2]["error"]["code"] == 500
    assert "step" in faulty_server.log() and "failed for request_id=fault-1" in faulty_server.log()
    # the engine keeps serving, and nothing stays allocated
    assert _complete(url, PROMPTS[0], 64).json()["choices"][0]["text"] == alone[PROMPTS[0]]
    assert httpx.get(url + "/health").status_code == 200
    assert faulty_server.wait_idle() == 0
    assert faulty_server.metric("novainfer:request_success_total", finished_reason="error") == 2


def test_dead_engine_loop_fails_in_flight_requests_and_the_server_exits_non_zero(tiny_qwen2, tmp_path_factory):
    srv = _server(tiny_qwen2, tmp_path_factory, fault="loop:die-")
    try:
        url = srv.url
        assert _complete(url, PROMPTS[0], 4).status_code == 200
        with (
            httpx.Client(timeout=30) as http,
            http.stream(
                "POST",
                url + "/v1/completions",
                json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True},
            ) as in_flight,
        ):
            lines = in_flight.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "choices" in first
            died = _complete(url, PROMPTS[2], 4, request_id="die-1")  # kills the loop once it has output
            rest = "\n".join(lines)
        assert died.status_code == 503 and died.json()["error"]["request_id"] == "die-1"
        events = _sse_events(rest)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503  # the stream ends, never hangs
        # the server then exits non-zero (a supervisor restarts it); until it has, it answers 503
        try:
            health = httpx.get(url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None
        assert health in (503, None)
        assert srv.proc.wait(timeout=15) == 1
        assert "engine loop died" in srv.log() and "server stopped because an engine died" in srv.log()
    finally:
        srv.stop()


def test_sigterm_drains_then_exits_zero(tiny_qwen2, tmp_path_factory):
    """In-flight requests finish within --shutdown-timeout or end with finish_reason "abort" and [DONE];
    new requests are refused; the process exits 0."""
    srv = _server(tiny_qwen2, tmp_path_factory, "--shutdown-timeout", "1.5", "--max-num-seqs", "1")
    url = srv.url

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:

            async def stream(max_tokens: int) -> str:
                body = {
                    "model": MODEL,
                    "prompt": PROMPTS[0],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                }
                async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                    return "\n".join([line async for line in resp.aiter_lines()])

            # one sequence runs at a time: the long ones can't all finish in 1.5 s (12 x 480 tokens; a fast core
            # decodes 4 x 480 of the tiny model in that time), the short one is first
            short = asyncio.create_task(stream(4))
            await asyncio.sleep(0.2)
            longs = [asyncio.create_task(stream(480)) for _ in range(12)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:
                late = (await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})).status_code
            except httpx.TransportError:
                late = "refused"
            bodies = await asyncio.wait_for(asyncio.gather(short, *longs), 30)
            return t0, late, bodies

    try:
        t0, late, bodies = asyncio.run(scenario())
        code = srv.proc.wait(timeout=20)
        assert code == 0, srv.log()
        assert time.monotonic() - t0 < 15
        assert late in (503, "refused")
        reasons = []
        for body in bodies:
            events = _sse_events(body)
            assert events[-1] == "[DONE]", body[-300:]
            reasons.append([e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1])
        assert reasons[0] == "length"
        assert set(reasons[1:]) <= {"length", "abort"} and "abort" in reasons[1:]
        assert "draining" in srv.log()
    finally:
        srv.stop()

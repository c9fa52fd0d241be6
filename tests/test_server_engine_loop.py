"""AsyncLLMEngine's lifecycle and failure handling, through the app in-process (FastAPI's TestClient)."""
import logging

import pytest
from fastapi.testclient import TestClient

from novainfer.config import EngineConfig, ServerConfig
from novainfer.engine.llm_engine import LLMEngine, RequestStatus
from novainfer.server.api_server import build_app
from novainfer.server.async_engine import IllegalTransitionError, TrackedRequest

BODY = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def engine(tiny_qwen2):
    return LLMEngine(EngineConfig.from_kwargs(tiny_qwen2, device="cpu", cpu_kv_cache_tokens=4096))


def test_lifecycle_refuses_and_logs_illegal_transitions(caplog):
    tracked = TrackedRequest("r1", "r1", queue=None)
    tracked.transition(RequestStatus.RUNNING)
    tracked.transition(RequestStatus.RUNNING)  # more output while running is not a transition
    tracked.transition(RequestStatus.FINISHED)
    with caplog.at_level(logging.WARNING), pytest.raises(IllegalTransitionError):
        tracked.transition(RequestStatus.CANCELLED)
    assert "request_id=r1 illegal transition finished -> cancelled" in caplog.text
    assert tracked.status == RequestStatus.FINISHED
    with pytest.raises(IllegalTransitionError):
        TrackedRequest("r2", "r2", queue=None).transition(RequestStatus.QUEUED)


def test_failed_step_fails_its_request_and_the_next_one_is_served(engine, monkeypatch):
    real = engine.executor.execute_model
    calls = []

    def flaky(sched):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return real(sched)
    monkeypatch.setattr(engine.executor, "execute_model", flaky)
    with TestClient(build_app([("m", engine)], ServerConfig())) as http:
        bad = http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "doomed"})
        assert bad.status_code == 500 and "device fell over" in bad.json()["error"]["message"]
        assert bad.json()["error"]["request_id"] == "doomed"
        ok = http.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").status_code == 200
        assert 'finished_reason="error"' in http.get("/metrics").text


def test_dead_engine_loop_answers_503(engine, monkeypatch):
    with TestClient(build_app([("m", engine)], ServerConfig())) as http:
        assert http.post("/v1/completions", json=BODY).status_code == 200

        def broken():
            raise RuntimeError("loop bug")
        monkeypatch.setattr(engine, "has_unfinished_requests", broken)
        in_flight = http.post("/v1/completions", json=BODY)
        assert in_flight.status_code == 503 and "loop bug" in in_flight.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        again = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert again.status_code == 503 and set(again.json()["error"]) >= {"message", "type", "param", "code"}

"""Readiness for Kubernetes and routers: /ready is 200 while serving and 503 from SIGTERM on, before the drain
(requests are still answered during --drain-delay); /health (liveness) stays; data parallelism is refused."""

import signal
import subprocess
import sys
import time

import httpx

from tests.server_utils import ROOT, RemoteServer


def test_ready_turns_503_at_sigterm_before_the_drain(tiny_qwen2, tmp_path):
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", "tiny", "--drain-delay", "1.5"], str(tmp_path / "server.log")
    )
    try:
        assert httpx.get(srv.url + "/ready").status_code == 200
        assert httpx.get(srv.url + "/v2/health/ready").status_code == 200
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while httpx.get(srv.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        r = httpx.get(srv.url + "/ready")
        assert r.json()["error"]["code"] == "not_ready"
        # not ready, but not draining yet: liveness holds and a request is still served
        assert httpx.get(srv.url + "/health").status_code == 200
        done = httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert done.status_code == 200
        assert srv.proc.wait(timeout=20) == 0, srv.log()
        assert "not ready; draining in 1.5 s" in srv.log()
    finally:
        srv.stop()


def test_data_parallel_is_refused_with_a_pointer_to_the_router_setup():
    run = subprocess.run(
        [sys.executable, "-m", "novainfer.entrypoints.cli", "serve", "--data-parallel-size", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode != 0
    assert "data_parallel_size=2" in run.stderr and "docs/DEPLOY.md" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1

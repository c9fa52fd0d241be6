"""Starts `novainfer serve` as a real subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The dense tiny models' servers compute in float32: the tests compare greedy text across batch compositions,
# which bf16 CPU GEMMs (the default where the CPU has AVX512-BF16 or AMX) do not keep bit for bit.
FLOAT32 = ("--dtype", "float32")


class RemoteServer:
    """`python -m novainfer.entrypoints.cli serve ...` (or another module's main) until stop(); url is the
    server's base URL."""

    def __init__(
        self,
        args: list[str],
        log_path: str,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        module: str = "novainfer.entrypoints.cli",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, **(env or {}), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "serve", *args, "--port", str(self.port), "--device", "cpu"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for line in text.splitlines():
            m = re.match(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
        return 0.0

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Wait until no request runs or waits; returns the KV-cache usage then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.metric("novainfer:num_requests_running") == 0
                and self.metric("novainfer:num_requests_waiting") == 0
            ):
                return self.metric("novainfer:kv_cache_usage_perc")
            time.sleep(0.05)
        raise TimeoutError("requests still running")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

"""Runs the app under uvicorn with a graceful drain on SIGTERM (and Ctrl-C).

On the signal the readiness route (/ready) turns 503 at once; after `drain_delay` seconds (0 by default: at once), time
for routers and Kubernetes to stop sending here, the server stops accepting connections and answers new generations with
503; requests in flight may finish for up to `shutdown_timeout` seconds, then the rest are aborted (streams end with
finish_reason "abort" and `data: [DONE]`); the engines stop and `run_server` returns, so the process exits 0.

When an engine dies (its core process ended or froze: the app sets `app.state.fatal`), its in-flight requests have
already failed with an error; the server shuts down the same way and `run_server` returns 1, so a supervisor
(systemd, Kubernetes) restarts it instead of keeping a process that answers 503 forever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from novainfer.config import ServerConfig
from novainfer.server.http_protocol import header_deadline_protocol

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that starts the app's drain when it is told to exit."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float, drain_delay: float = 0.0):
        super().__init__(config)
        self.app, self.shutdown_timeout, self.drain_delay = app, shutdown_timeout, drain_delay
        self._delayed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Turn not-ready; drain after drain_delay (a second signal drains at once)."""
        if self.drain_delay > 0 and not self._delayed and not self.should_exit:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._delayed = True
                self.app.state.ready = False
                logger.info("signal %d: not ready; draining in %.1f s", sig, self.drain_delay)
                loop.call_later(self.drain_delay, self._drain_after_delay, sig)
                return
        self.app.state.ready = False
        if not self.should_exit:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # the signal arrived outside the loop (start-up): nothing to drain
                loop = None
            if loop is not None:
                logger.info(
                    "signal %d: draining, in-flight requests have %.1f s before they are aborted",
                    sig,
                    self.shutdown_timeout,
                )
                loop.call_soon(self.app.state.serving.begin_drain, self.shutdown_timeout)
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if getattr(self.app.state, "fatal", None) and not self.should_exit:
            logger.error("shutting down: %s", self.app.state.fatal)
            self.should_exit = True
        return await super().on_tick(counter)

    def _drain_after_delay(self, sig: int) -> None:
        if not self.should_exit:  # a second signal may have started the drain already
            self.handle_exit(sig, None)


def run_server(app: FastAPI, config: ServerConfig, log_level: str) -> int:
    """Serve until SIGTERM/SIGINT or an engine's death, then drain (see the module docstring); the exit code."""
    # uvicorn raises the signal it handled again once it has shut down; the drain already did the work,
    # so that second delivery must not kill the process with a signal status instead of exit code 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        http=header_deadline_protocol(config.request_header_timeout),
        timeout_keep_alive=config.keep_alive_timeout,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=int(config.shutdown_timeout) + 5,
    )
    DrainingServer(uv_config, app, config.shutdown_timeout, config.drain_delay).run()
    if getattr(app.state, "fatal", None):
        logger.error("server stopped because an engine died")
        return 1
    logger.info("server stopped")
    return 0

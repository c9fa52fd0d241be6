"""uvicorn's h11 protocol with a deadline on each request head (slowloris).

uvicorn arms no timer on a new connection, and its keep-alive timer is cancelled by any byte received, so a
client that sends a partial request head, a byte now and then, holds a connection (and its buffers) for ever.
Here a connection that has not sent a whole request head within `header_timeout` seconds of connecting, or of
the first byte of its next request, is closed, however it trickles. A silent keep-alive connection is left to
uvicorn's keep-alive timeout: closing it sooner would race a client that reuses it at that moment.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete `header_timeout` s after the
    connection opened or the head's first byte came."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and self.conn.their_state is h11.IDLE:  # a keep-alive's next request
            self._arm_head_deadline()
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_head_deadline()
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a pipelined head waits
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_deadline_passed)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_deadline_passed(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no whole head yet
            logger.info(
                "%s: closed, no whole request head within %g s (--request-header-timeout)",
                "%s:%d" % self.client if self.client else "client",
                self.header_timeout,
            )
            self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": header_timeout})

"""Bounded response writes and event streams that always clean up.

A client that stops reading fills the socket buffers, and every later write then waits for it. bounded_send gives
each body write --stream-write-timeout seconds; past it the connection is dropped (ClientStalledError). EventStream
closes its body iterator and runs its background task however the stream ends (finished, client gone, stalled), so
the generation is aborted and its admission slot returned at once, not whenever the generator is collected.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from fastapi.responses import StreamingResponse

Send = Callable[[dict], Awaitable[None]]


class ClientStalledError(ConnectionError):
    """A response write waited longer than the write timeout: the client stopped reading."""


def bounded_send(send: Send, timeout: float) -> Send:
    """send, with every body write bounded by `timeout` seconds (ClientStalledError past it)."""

    async def bounded(message: dict) -> None:
        if message["type"] != "http.response.body":
            return await send(message)
        try:
            await asyncio.wait_for(send(message), timeout)
        except asyncio.TimeoutError:
            raise ClientStalledError(f"the client read nothing for {timeout} s (--stream-write-timeout)") from None

    return bounded


class EventStream(StreamingResponse):
    """A text/event-stream response whose iterator is closed and background task run however the stream ends."""

    def __init__(self, content: Any, background: Any = None):
        super().__init__(content, media_type="text/event-stream", background=background)

    async def __call__(self, scope: dict, receive: Any, send: Send) -> None:
        background, self.background = self.background, None
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if background is not None:
                await background()

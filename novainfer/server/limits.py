"""Admission control: at most max_concurrent generation requests in flight and max_queue_len waiting.

A request past both bounds is refused at once (HTTP 429 with Retry-After), so nothing queues unboundedly.
"""

from __future__ import annotations

import asyncio


class OverloadedError(RuntimeError):
    """The server is at its concurrency and queue bounds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Slot:
    """One admitted request's hold on the limiter; release() is idempotent."""

    def __init__(self, limiter: "AdmissionLimiter"):
        self._limiter: AdmissionLimiter | None = limiter

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter._semaphore.release()
            self._limiter = None


class AdmissionLimiter:
    def __init__(self, max_concurrent: int, max_queue_len: int, retry_after: int = 1):
        if max_concurrent < 1 or max_queue_len < 0:
            raise ValueError(
                f"max_concurrent_requests must be >= 1 and max_queue_len >= 0, got {max_concurrent} and {max_queue_len}"
            )
        self.max_concurrent = max_concurrent
        self.max_queue_len = max_queue_len
        self.retry_after = retry_after
        self._semaphore = asyncio.Semaphore(max_concurrent)
        self.num_waiting = 0

    @property
    def num_active(self) -> int:
        return self.max_concurrent - self._semaphore._value

    def check(self) -> None:
        """Raise OverloadedError now if a request arriving now would be refused: called before any tokenization or
        template work, so a burst's refusals cost the event loop no more than their parsing."""
        if self._semaphore.locked() and self.num_waiting >= self.max_queue_len:
            raise self._overloaded()

    def _overloaded(self) -> OverloadedError:
        return OverloadedError(
            f"server is at capacity: {self.num_active} requests in flight "
            f"(max_concurrent_requests={self.max_concurrent}) and {self.num_waiting} "
            f"queued (max_queue_len={self.max_queue_len}); retry later",
            self.retry_after,
        )

    async def acquire(self) -> Slot:
        """Wait for a slot if the queue has room; raise OverloadedError if it has none."""
        self.check()
        self.num_waiting += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.num_waiting -= 1
        return Slot(self)

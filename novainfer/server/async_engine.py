"""The server's asynchronous engines: submit / stream / cancel on the event loop, one asyncio.Queue of
outputs per request. Each request follows a lifecycle (queued -> running -> finished | cancelled | failed);
an illegal transition is refused and logged.

AsyncEngineBase holds that request side; AsyncLLM (server/async_llm.py) builds on it and talks to an engine
core in its own process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from novainfer.engine.output_processor import RequestStatus
from novainfer.engine.messages import SchedulerStats
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from novainfer.config import EngineConfig

logger = logging.getLogger(__name__)

_TERMINAL = {RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED}
_ALLOWED = {RequestStatus.QUEUED: {RequestStatus.RUNNING} | _TERMINAL, RequestStatus.RUNNING: set(_TERMINAL)}


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served until restart."""


class DuplicateRequestError(ValueError):
    """A request id that a live request already uses (the HTTP layer answers 409; the first is untouched)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its step raised)."""


class IllegalTransitionError(RuntimeError):
    """A lifecycle change the state machine does not allow."""


@dataclass
class TrackedRequest:
    """The asyncio side of one request: its lifecycle state, output queue and timings."""

    request_id: str
    group: str
    queue: asyncio.Queue
    status: RequestStatus = RequestStatus.QUEUED
    arrival_time: float = field(default_factory=time.monotonic)
    first_output_time: float | None = None
    last_output: RequestOutput | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status in _TERMINAL

    def check(self, new: RequestStatus) -> None:
        """Raise (and log) IllegalTransitionError unless the lifecycle allows moving to `new` now."""
        if new == self.status == RequestStatus.RUNNING or new in _ALLOWED.get(self.status, ()):
            return
        logger.warning(
            "request_id=%s illegal transition %s -> %s refused", self.request_id, self.status.value, new.value
        )
        raise IllegalTransitionError(f"request {self.request_id}: {self.status.value} -> {new.value}")

    def transition(self, new: RequestStatus) -> None:
        """Move to `new`, refusing moves the lifecycle does not allow."""
        self.check(new)
        self.status = new


FinishedHook = Callable[[TrackedRequest, str | None], None]
DeadHook = Callable[[str], None]
StatsHook = Callable[[SchedulerStats], None]


class AsyncEngineBase(ABC):
    """The event loop's side of an engine: tracked requests, their output queues and lifecycles."""

    model_path: str
    max_model_len: int
    tokenizer: Any  # for the event loop's own use (chat templates, /tokenize)
    config: EngineConfig  # and the KV cache's size: vllm:cache_config_info (server/metrics.py)
    num_blocks: int

    def __init__(self, on_stats: StatsHook | None = None, on_finished: FinishedHook | None = None):
        self.on_stats = on_stats  # the core's gauges and counters, after each step (metrics)
        self.on_finished = on_finished  # called on the event loop when a request reaches a terminal state
        self.on_dead: DeadHook | None = None  # called once, with the reason, when the engine dies (server exits)
        self.step_timeout: float | None = None  # seconds without step progress, while requests wait, until dead
        self.dead_reason: str | None = None
        self._requests: dict[str, TrackedRequest] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @abstractmethod
    def start(self) -> None:
        """Start delivering outputs; call from the event loop that will consume them."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (its thread or its process)."""

    @abstractmethod
    async def _add(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        """Hand a tracked request to the engine; ValueError when it refuses it."""

    @abstractmethod
    def _abort(self, request_id: str) -> None:
        """Ask the engine to stop a request; its final output (finish_reason "abort") follows."""

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # ---- the public API (event loop side) ---------------------------------------------------------
    async def submit(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, group: str | None = None
    ) -> TrackedRequest:
        """Queue a request; its TrackedRequest is what release() takes. DuplicateRequestError while a live
        request has that id, ValueError if the engine refuses it, EngineDeadError if the engine died."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if self.in_use(request_id):
            raise DuplicateRequestError(f"request_id {request_id!r} is already in use by a running request")
        tracked = TrackedRequest(request_id, group or request_id, asyncio.Queue())
        self._requests[request_id] = tracked
        try:
            await self._add(request_id, prompt, params)
        except BaseException:
            if self._requests.get(request_id) is tracked:
                del self._requests[request_id]
                if not self.is_dead:
                    self._abort(request_id)  # in case the add went through before we stopped waiting
            raise
        return tracked

    def in_use(self, request_id: str) -> bool:
        """Whether a tracked request has this id now."""
        return request_id in self._requests

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs in order, ending with its finished one."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        while True:
            item = await tracked.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def cancel(self, request_id: str) -> bool:
        """Abort a request (or every request of a group); False when nothing live has that id."""
        return self._cancel(lambda t: request_id in (t.request_id, t.group)) > 0

    def cancel_all(self) -> int:
        """Abort every live request (server shutdown); returns how many were live."""
        return self._cancel(lambda t: True)

    def _cancel(self, match: Callable[[TrackedRequest], bool]) -> int:
        live = 0
        for t in [t for t in self._requests.values() if match(t)]:
            try:  # the state machine refuses (and logs) cancelling a request that already ended
                t.check(RequestStatus.CANCELLED)
            except IllegalTransitionError:
                continue
            live += 1
            self._abort(t.request_id)  # the engine's abort output moves it to cancelled
        return live

    def release(self, tracked: TrackedRequest) -> None:
        """Forget a request whose consumer is done; abort it first if it is still live (idempotent). Takes the
        TrackedRequest submit() returned, so a later request reusing the id is never the one released."""
        if self._requests.get(tracked.request_id) is not tracked:
            return
        if not tracked.is_terminal and not self.is_dead:
            self._abort(tracked.request_id)  # delivered while still tracked: its final output ends it
            if not tracked.is_terminal:
                self._finish(tracked, RequestStatus.CANCELLED, "abort")
        del self._requests[tracked.request_id]

    # ---- outputs, on the event loop ----------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None or tracked.is_terminal:
                continue
            if out.error is not None:  # the engine failed this request alone; its partial output is dropped
                self._fail([out.request_id], RequestFailedError(f"request {out.request_id} failed: {out.error}"))
                continue
            tracked.first_output_time = tracked.first_output_time or now
            tracked.last_output = out
            tracked.queue.put_nowait(out)
            if not out.finished:
                tracked.transition(RequestStatus.RUNNING)
            elif any(c.finish_reason == "abort" for c in out.outputs):
                self._finish(tracked, RequestStatus.CANCELLED, "abort")
            else:
                self._finish(tracked, RequestStatus.FINISHED, out.outputs[0].finish_reason)

    def _finish(self, tracked: TrackedRequest, status: RequestStatus, reason: str | None) -> None:
        tracked.transition(status)
        if self.on_finished is not None:
            self.on_finished(tracked, reason)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            tracked = self._requests.get(request_id)
            if tracked is not None and not tracked.is_terminal:
                self._finish(tracked, RequestStatus.FAILED, "error")
                tracked.queue.put_nowait(exc)

    def _die(self, reason: str) -> None:
        """The engine is gone: every live request fails with EngineDeadError, and so will new ones."""
        first = self.dead_reason is None
        if first:
            logger.error("%s", reason)
            self.dead_reason = reason
        self._fail(list(self._requests), EngineDeadError(self.dead_reason))
        if first and self.on_dead is not None:
            self.on_dead(reason)

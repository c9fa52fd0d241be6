"""AsyncLLMEngine: drives LLMEngine.step() in one background thread and streams outputs to asyncio.

LLMEngine is not thread-safe, so only the engine thread touches it: submit and cancel post commands to a
thread-safe inbox that the thread drains before each step. Outputs go back to the event loop with
call_soon_threadsafe, into one asyncio.Queue per request. Each request follows a lifecycle
(queued -> running -> finished | cancelled | failed); an illegal transition is refused and logged.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from novainfer.engine.llm_engine import LLMEngine, RequestStatus
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_TERMINAL = {RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED}
_ALLOWED = {
    RequestStatus.QUEUED: {RequestStatus.RUNNING} | _TERMINAL,
    RequestStatus.RUNNING: set(_TERMINAL),
}


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served until restart."""


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
        logger.warning("request_id=%s illegal transition %s -> %s refused", self.request_id,
                       self.status.value, new.value)
        raise IllegalTransitionError(f"request {self.request_id}: {self.status.value} -> {new.value}")

    def transition(self, new: RequestStatus) -> None:
        """Move to `new`, refusing moves the lifecycle does not allow."""
        self.check(new)
        self.status = new


FinishedHook = Callable[[TrackedRequest, str | None], None]


class AsyncLLMEngine:
    """submit / stream / cancel over one LLMEngine whose loop runs in a dedicated thread."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine], None] | None = None,
                 on_finished: FinishedHook | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (metrics gauges)
        self.on_finished = on_finished  # called on the event loop when a request reaches a terminal state
        self.dead_reason: str | None = None
        self._requests: dict[str, TrackedRequest] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._in_engine: set[str] = set()  # engine-thread view of the ids LLMEngine holds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle of the loop -----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="novainfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # ---- the public API (event loop side) ---------------------------------------------------------
    async def submit(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                     group: str | None = None) -> str:
        """Queue a request; ValueError if the engine refuses it, EngineDeadError if the loop died."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        tracked = TrackedRequest(request_id, group or request_id, asyncio.Queue())
        self._requests[request_id] = tracked
        added = self._loop.create_future()
        self._post(("add", request_id, prompt, params, added))
        try:
            await added
        except BaseException:
            self._requests.pop(request_id, None)
            self._post(("abort", request_id))  # in case the add went through before we stopped waiting
            raise
        return request_id

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
            self._post(("abort", t.request_id))  # the engine's abort output moves it to cancelled
        return live

    def release(self, request_id: str) -> None:
        """Forget a request whose consumer is done; abort it first if it is still live (idempotent)."""
        tracked = self._requests.pop(request_id, None)
        if tracked is not None and not tracked.is_terminal and not self.is_dead:
            self._post(("abort", request_id))
            self._finish(tracked, RequestStatus.CANCELLED, "abort")

    # ---- the engine thread ---------------------------------------------------------------------
    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                step_id = self.engine.step_id
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # the engine failed that step's requests and keeps going
                    lost = [r for r in self._in_engine if r not in self.engine.requests]
                    self._in_engine.difference_update(lost)
                    self._call(self._fail, lost, RequestFailedError(f"engine step failed: {exc!r}"))
                    continue
                self._publish(outputs)
                if self.engine.step_id == step_id:
                    time.sleep(0.001)  # nothing was schedulable: don't spin
        except BaseException as exc:  # the loop itself broke: nothing can be trusted any more
            logger.exception("engine loop died")
            self.dead_reason = f"engine loop died: {exc!r}"
            self._call(self._fail_all)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, added = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:
                    self._call(_settle, added, exc)
                else:
                    self._in_engine.add(request_id)
                    self._call(_settle, added, None)
            else:
                out = self.engine.abort_request(command[1])
                self._publish([out] if out is not None else [])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if self.engine.faults:  # tests only: a fault here is outside step()'s guard and kills the loop
            for out in outputs:
                self.engine.faults.check("loop", out.request_id)
        for out in outputs:
            if out.finished:
                self._in_engine.discard(out.request_id)
        if self.on_step is not None:
            self.on_step(self.engine)
        if outputs:
            self._call(self._deliver, outputs)

    def _call(self, fn: Callable, *args) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    # ---- back on the event loop ------------------------------------------------------------------
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

    def _fail_all(self) -> None:
        self._fail(list(self._requests), EngineDeadError(self.dead_reason))
        while True:  # adds the dead loop never saw
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _settle(command[4], EngineDeadError(self.dead_reason))


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

"""AsyncLLMEngine: an in-process LLMEngine driven by one background thread of the server's process
(`novainfer serve --engine-core thread`; the layout before the engine core had its own process).

LLMEngine is not thread-safe, so only the engine thread touches it: submit and cancel post commands to a
thread-safe inbox that the thread drains before each step. Outputs go back to the event loop with
call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from typing import Callable

from novainfer.engine.llm_engine import LLMEngine
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams
from novainfer.server.async_engine import (AsyncEngineBase, EngineDeadError, FinishedHook, RequestFailedError,
                                           StatsHook)

logger = logging.getLogger(__name__)


class AsyncLLMEngine(AsyncEngineBase):
    """An in-process LLMEngine whose loop runs in a dedicated thread of the server's process."""

    def __init__(self, engine: LLMEngine, on_stats: StatsHook | None = None,
                 on_finished: FinishedHook | None = None):
        super().__init__(on_stats, on_finished)
        self.engine = engine
        self.model_path, self.max_model_len = engine.config.model_config.model, engine.max_model_len
        self.config, self.num_blocks = engine.config, engine.engine_core.num_blocks
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the engine thread uses the original concurrently
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._in_engine: set[str] = set()  # engine-thread view of the ids LLMEngine holds
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="novainfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def _add(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        added = self._loop.create_future()
        self._post(("add", request_id, prompt, params, added))
        await added

    def _abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

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
            self._call(self._die_and_refuse, f"engine loop died: {exc!r}")

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
        if self.on_stats is not None:
            self.on_stats(self.engine.make_stats())
        if outputs:
            self._call(self._deliver, outputs)

    def _call(self, fn: Callable, *args) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def _die_and_refuse(self, reason: str) -> None:
        self._die(reason)
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

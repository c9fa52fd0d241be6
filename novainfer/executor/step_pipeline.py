"""A worker's launched steps (mp backend with async scheduling), read back in order on a thread of their own.

The worker's main thread launches a step (the runner's execute_model_async) and goes straight back to the
driver's next call, so the device always has the next step queued; this thread waits for each launched step
in launch order, and on rank 0 sends its output to the driver ([(rank, ok, output or traceback)], the reply
a synchronous step gets), as vLLM's multiproc workers do with async scheduling. Every rank runs one: on the
other ranks it only waits, so a step that raises there ends the process (the driver names the rank).

At most two steps are in flight per rank: the runner fills step N+2's host buffers where step N's were, so
step N must be done first (on rank 0 the driver has already read it by then; a lagging peer may not have).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections import deque
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2


class FailedLaunch:
    """A step whose launch raised: reading it back raises, with the launch's traceback."""

    def __init__(self, trace: str):
        self.trace = trace

    def get(self) -> Any:
        raise RuntimeError(self.trace)


class StepPipeline:
    """Launched steps of one worker, completed (and on rank 0 answered) in launch order by one thread."""

    def __init__(self, rank: int, send: Callable[[Any], None] | None, device: torch.device | None = None):
        self.rank, self.send = rank, send  # send: rank 0's pipe to the driver; None on the other ranks
        self.device = device
        self._steps: deque = deque()  # launched and not yet read back, oldest first
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"novainfer-step-replies-{rank}", daemon=True)
        self._thread.start()

    def launch(self, start: Callable[[], Any]) -> None:
        """Launch a step with start() (returns a handle whose get() reads it back); its reply follows."""
        with self._cond:
            while len(self._steps) >= MAX_IN_FLIGHT:
                self._cond.wait()
        try:
            handle = start()
        except Exception:  # noqa: BLE001 - reported in order, as the step's reply
            handle = FailedLaunch(traceback.format_exc())
        with self._cond:
            self._steps.append(handle)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every launched step is read back (and answered): before any other call runs."""
        with self._cond:
            while self._steps:
                self._cond.wait()

    def close(self, timeout: float = 30.0) -> None:
        """Read back what is in flight, then stop the thread (bounded: a step stuck on a dead peer is left)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            with self._cond:
                while not self._steps and not self._closed:
                    self._cond.wait()
                if not self._steps:
                    return
                handle = self._steps[0]
            try:
                reply = (self.rank, True, handle.get())
            except Exception:  # noqa: BLE001 - the driver raises it, naming this rank
                reply = (self.rank, False, handle.trace if isinstance(handle, FailedLaunch) else traceback.format_exc())
            if self.send is not None:
                try:
                    self.send([reply])
                except OSError:  # the driver is gone; the main thread sees EOF on its next read
                    pass
            elif not reply[1]:  # nobody collects this rank's reply: exit, so the driver notices and names it
                logger.error("rank %d failed in a launched step:\n%s", self.rank, reply[2])
                sys.stderr.flush()
                os._exit(1)
            with self._cond:
                self._steps.popleft()
                self._cond.notify_all()

"""The engine core's process: an EngineCore behind two ZMQ sockets, in a busy loop.

The loop drains new requests and aborts from its input socket (PULL, bound here), runs one step, and sends
the step's outputs and stats as one message (PUSH, connected to the front-end). A message that does not
decode is logged with the request id it seems to carry, answered with an error output when it names one,
and dropped. The process leaves by itself when its parent (the front-end) is gone, so no orphan keeps a
device; SIGINT is ignored (the front-end drains, then stops the core) and SIGTERM exits cleanly.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

import torch
import zmq

from novainfer.config import EngineConfig
from novainfer.engine.core import EngineCore
from novainfer.engine.gc_heap import freeze_startup_heap
from novainfer.engine.malloc_heap import trim_malloc_heap
from novainfer.engine.messages import (
    CoreInput,
    EngineCoreAbort,
    EngineCoreAdd,
    EngineCoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    MessageCodec,
    request_id_of,
)
from novainfer.loader.model_info import load_model_info

logger = logging.getLogger(__name__)
PARENT_POLL_S = 0.5


class EngineCoreProc:
    """The busy loop around one EngineCore."""

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket):
        self.core, self.input_socket, self.output_socket = core, input_socket, output_socket
        self.inputs = MessageCodec(CoreInput)
        self.outputs = MessageCodec(EngineCoreOutputs)
        self.trim_when_idle = core.config.trim_heap_when_idle
        self.heap_dirty = True  # steps (or the model's load) freed memory since the last trim

    def run_busy_loop(self) -> None:
        while True:
            self.process_input_queue(block=not self.core.has_unfinished_requests())
            self.step()

    def process_input_queue(self, block: bool) -> None:
        """Apply every waiting message (waiting for one when idle); report stats after any change."""
        if block:
            if self.trim_when_idle and self.heap_dirty:
                trim_malloc_heap()
                self.heap_dirty = False
            while not self.input_socket.poll(1000):
                pass
        handled = 0
        while True:
            try:
                data = self.input_socket.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._handle(data)
            handled += 1
        if handled:  # an abort frees blocks and changes the gauges even when no step follows
            self._send(EngineCoreOutputs(scheduler_stats=self.core.make_stats(), timestamp=time.monotonic()))

    def _handle(self, data: bytes) -> None:
        try:
            message = self.inputs.decode(data)
        except Exception as exc:  # msgspec's errors, or whatever a field's own check raised while decoding
            request_id = request_id_of(data)
            logger.warning("request_id=%s malformed message dropped (%d bytes): %s", request_id, len(data), exc)
            if request_id is not None:
                self._send_error(request_id, f"malformed message: {exc}")
            return
        if isinstance(message, EngineCoreAdd):
            try:
                self.core.add_request(message.request)
            except Exception as exc:  # ValueError: not servable; anything else: a message that made no sense
                logger.warning("request_id=%s refused: %r", message.request.request_id, exc)
                self._send_error(message.request.request_id, f"{type(exc).__name__}: {exc}")
        elif isinstance(message, EngineCoreAbort):
            self.core.abort_requests(message.targets)

    def step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception:  # logged by the core, which failed the step's requests; the loop goes on
            outputs = EngineCoreOutputs(self.core.pop_failed_outputs(), self.core.make_stats(), time.monotonic())
        if outputs is None:
            if self.core.has_unfinished_requests():
                time.sleep(0.001)  # nothing was schedulable: don't spin
            return
        self.heap_dirty = True
        self._send(outputs)

    def _send_error(self, request_id: str, error: str) -> None:
        out = EngineCoreOutput(request_id, finish_reason="error", error=error)
        self._send(EngineCoreOutputs([out], self.core.make_stats(), time.monotonic()))

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output_socket.send(self.outputs.encode(outputs), copy=False)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the front-end is gone (we are re-parented); workers of the mp backend see their pipe close."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.warning("the front-end (pid %d) is gone: the engine core exits", parent_pid)
            logging.shutdown()
            os._exit(1)


FRONT_END_PRIORITY = 5  # how much nicer the engine core runs than the front-end on a CPU device


def cpu_threads() -> int:
    """Torch threads for a core on the CPU: every core this process may use but one, left to the front-end.
    Two processes whose threads together outnumber the cores make each parallel op wait for a descheduled
    thread (a whole time slice), which costs far more than the thread gives."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _on_sigterm(*_: object) -> None:
    raise SystemExit(0)


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int, log_level: int
) -> None:
    """The core process's entry point (started by engine/core_client.py). It loads the model's config and
    tokenizer itself (the front-end never imports torch, which transformers' loaders do) and sends the
    tokenizer back, pickled, in its ready message."""
    logging.basicConfig(
        level=log_level,
        stream=sys.stderr,
        force=True,  # not the front-end's handlers (fork)
        format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    if config.resolve_device().type == "cpu":
        # the front-end shares these cores: a niced engine lets it answer (a 429, a stream's next chunk) at once
        # when it wakes, and costs the engine nothing while the front-end sleeps (before any thread starts)
        os.nice(FRONT_END_PRIORITY)
        torch.set_num_threads(cpu_threads())
        from novainfer.kernels.cpu import library

        library.set_num_threads(len(os.sched_getaffinity(0)))  # their pool copes with a busy front-end
    ctx = zmq.Context()
    out_socket = ctx.socket(zmq.PUSH)
    out_socket.setsockopt(zmq.SNDHWM, 0)
    out_socket.setsockopt(zmq.LINGER, 1000)
    out_socket.connect(output_address)
    encoder = MessageCodec(EngineCoreOutputs)
    core = None
    try:
        config, tokenizer, eos_token_ids = load_model_info(config)
        core = EngineCore(config, eos_token_ids)
        ready = EngineCoreReady(
            os.getpid(),
            core.max_model_len,
            core.num_blocks,
            core.vocab_size,
            sorted(eos_token_ids),
            pickle.dumps(tokenizer),
        )
        del tokenizer  # structured outputs load their own when the first constrained request comes (as before)
        freeze_startup_heap()
        in_socket = ctx.socket(zmq.PULL)
        in_socket.setsockopt(zmq.RCVHWM, 0)
        in_socket.bind(input_address)
        out_socket.send(encoder.encode(ready))
        EngineCoreProc(core, in_socket, out_socket).run_busy_loop()
    except SystemExit:
        logger.info("engine core stopping")
    except BaseException as exc:
        if core is not None:
            logger.exception("engine loop died")
            reason = f"engine loop died: {exc!r}"
        else:  # most often the user's model or settings: the front-end reports the message, traceback on demand
            if os.environ.get("NOVAINFER_DEBUG"):
                logger.exception("engine core failed to start")
            reason = (
                str(exc)
                if isinstance(exc, (ValueError, OSError, NotImplementedError))
                else f"{type(exc).__name__}: {exc}"
            )
        out_socket.send(encoder.encode(EngineCoreDead(reason)))
        raise SystemExit(1) from None
    finally:
        if core is not None:
            core.shutdown()
        ctx.destroy(linger=1000)  # closes both sockets; a last message (EngineCoreDead) gets a second to leave

"""The front-end's handle on an engine core process (vLLM's AsyncMPClient): it starts the process, waits
for its ready message, sends requests and aborts, and yields the core's step outputs on the event loop.

The in-process alternative is LLMEngine, which holds an EngineCore directly (offline LLM, CLI generate/chat).
The core gets its EngineConfig once, as the new process's arguments; every message after that is msgspec.
The front-end never imports torch (nor transformers' config and model modules, which import it): the core
loads the model's config and tokenizer and sends the tokenizer back with its ready message. On the CPU the
process is forked (from a process without torch: the child imports what it needs); where CUDA may be used
it is spawned, as before (config.may_use_cuda decides without torch).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import tempfile
import time
import weakref

import msgspec
import zmq
import zmq.asyncio

from novainfer.config import EngineConfig
from novainfer.engine.messages import (
    AbortTarget,
    CoreOutput,
    EngineCoreAbort,
    EngineCoreAdd,
    EngineCoreDead,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    MessageCodec,
    request_id_of,
)

logger = logging.getLogger(__name__)


class EngineCoreStartError(RuntimeError):
    """The engine core process failed to load its model or exited before it was ready."""


class AsyncMPClient:
    """One engine core process and the two sockets to it."""

    def __init__(
        self, config: EngineConfig, startup_timeout: float = 1800.0, import_while_loading: tuple[str, ...] = ()
    ):
        """Starts the core and waits until it is ready. import_while_loading: modules this process will need
        (a server's app), imported while the core loads its model rather than before or after."""
        self._dir = _ipc_dir()
        self.input_address = f"ipc://{self._dir}/input"
        self.output_address = f"ipc://{self._dir}/output"
        start_method = "spawn" if config.may_use_cuda() else "fork"
        self.proc = multiprocessing.get_context(start_method).Process(
            target=_run_engine_core,
            name="novainfer-engine-core",
            daemon=False,  # its TP workers are its children
            args=(
                config,
                self.input_address,
                self.output_address,
                os.getpid(),
                logging.getLogger().getEffectiveLevel(),
            ),
        )
        self.proc.start()  # before this process has a ZMQ context, which a fork must not inherit
        self._ctx = zmq.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self.output_address)
        self._codec = MessageCodec(CoreOutput)
        self._encoder = msgspec.msgpack.Encoder()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._ctx, self._dir, 5.0)
        logger.info(
            "engine core process pid=%d started (input %s, output %s)",
            self.proc.pid,
            self.input_address,
            self.output_address,
        )
        # the tokenizer's pickle needs transformers' tokenizer classes (~1 s): they too load meanwhile
        for module in ("transformers.tokenization_utils_tokenizers", *import_while_loading):
            importlib.import_module(module)
        self.ready = self._wait_ready(startup_timeout)
        self.tokenizer = pickle.loads(self.ready.tokenizer)  # our own child's, over our private directory
        self.ready.tokenizer = b""
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.connect(self.input_address)
        self._async_output: zmq.asyncio.Socket | None = None

    def _wait_ready(self, timeout: float) -> EngineCoreReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._output.poll(200):
                message = self._decode(self._output.recv())
                if isinstance(message, EngineCoreReady):
                    return message
                if isinstance(message, EngineCoreDead):
                    self.shutdown()
                    raise EngineCoreStartError(message.reason)
            elif not self.proc.is_alive():
                self.shutdown()
                raise EngineCoreStartError(
                    f"the engine core process exited with code {self.proc.exitcode} "
                    "before it was ready (see its log above)"
                )
        self.shutdown()
        raise EngineCoreStartError(f"the engine core was not ready within {timeout:.0f} s")

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process ends."""
        return self.proc.sentinel

    def add_request(self, request: EngineCoreRequest) -> None:
        self._input.send(self._encoder.encode(EngineCoreAdd(request)), copy=False)

    def abort_requests(self, targets: list[AbortTarget]) -> None:
        self._input.send(self._encoder.encode(EngineCoreAbort(targets)), copy=False)

    async def get_output(self) -> EngineCoreOutputs | EngineCoreDead:
        """The core's next step outputs (or its death notice); malformed messages are logged and dropped."""
        if self._async_output is None:
            self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        while True:
            message = self._decode(await self._async_output.recv())
            if isinstance(message, (EngineCoreOutputs, EngineCoreDead)):
                return message

    def _decode(self, data: bytes) -> object | None:
        try:
            return self._codec.decode(data)
        except Exception as exc:  # msgspec's errors, or whatever a field's own check raised while decoding
            logger.warning(
                "request_id=%s malformed message from the engine core dropped (%d bytes): %s",
                request_id_of(data),
                len(data),
                exc,
            )
            return None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core process (SIGTERM, then SIGKILL after `timeout`) and close the sockets; idempotent."""
        self._finalizer.detach()
        _stop(self.proc, self._ctx, self._dir, timeout)


_IPC_DIR = re.compile(r"novainfer-core-(\d+)-\w+")  # novainfer-core-<front-end pid>-<random>


def _ipc_dir() -> str:
    """A private directory for the two sockets, named after this process. Those of front-ends that were killed
    (so never removed theirs) are removed first: their pid is gone."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = _IPC_DIR.fullmatch(name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"novainfer-core-{os.getpid()}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _run_engine_core(*args: object) -> None:
    """The core process's target: imports the core (and with it torch) in the child only."""
    from novainfer.engine.core_proc import run_engine_core

    run_engine_core(*args)


def _stop(proc: multiprocessing.Process, ctx: zmq.Context, directory: str, timeout: float) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    ctx.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)

"""The mp backend: one worker process per device over torch.distributed (NCCL on GPU, gloo on the CPU).

The driver (the engine's process) keeps no rank: it spawns this node's ranks, talks to rank 0 through a
pipe and watches every local process, so a worker that dies makes the next call raise, naming its rank,
instead of hanging in a collective. Ranks on other nodes are started there by `python -m
novainfer.executor.node_worker` with the same model and node_rank > 0; they follow rank 0's broadcasts.

With async scheduling, execute_model_async sends a step without waiting for the one before: the workers
launch it at once and rank 0 answers each step when it is done, in order (executor/step_pipeline.py).
RemoteStep.get() reads replies up to its own; any other call reads the outstanding step replies first.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import socket
import weakref
from collections import deque
from typing import Any, Callable

import torch.multiprocessing as mp

from novainfer.config import EngineConfig
from novainfer.executor.base import Executor
from novainfer.executor.step_wire import StepPacker
from novainfer.executor.worker_proc import run_worker
from novainfer.step_types import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def start_local_workers(config: EngineConfig, hf_config: Any) -> tuple[list, Any]:
    """Spawn this node's ranks; returns (processes in local-rank order, the driver's end of rank 0's pipe)."""
    pc = config.parallel_config
    ctx = mp.get_context("spawn")
    procs, driver_conn = [], None
    for local_rank in range(pc.ranks_per_node):
        rank = pc.node_rank * pc.ranks_per_node + local_rank
        child_conn = None
        if rank == 0:
            driver_conn, child_conn = ctx.Pipe()
        p = ctx.Process(
            target=run_worker,
            name=f"novainfer-tp-rank{rank}",
            daemon=True,
            args=(child_conn, config, hf_config, rank, local_rank, logging.getLogger().getEffectiveLevel()),
        )
        p.start()
        p.tp_rank = rank
        procs.append(p)
        if child_conn is not None:
            child_conn.close()  # the driver keeps one end only, so a dead rank 0 reads as EOF
    return procs, driver_conn


def stop_workers(procs: list, timeout: float = 10.0) -> None:
    """Wait for workers to exit, then terminate and kill what is left (never leaves orphans)."""
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: Any):
        super().__init__(config, hf_config)
        if config.parallel_config.node_rank != 0:
            raise ValueError(
                f"node_rank={config.parallel_config.node_rank}: only node 0 runs the engine; "
                "start the other nodes with `python -m novainfer.executor.node_worker`"
            )
        self._init_executor()

    def _distributed_args(self) -> tuple[str, int, int]:
        """(distributed_init_method, rank, local_rank) of the first rank this executor starts."""
        return self.config.parallel_config.distributed_init_method, 0, 0

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        if pc.master_port == 0:  # one node: any free port on this machine
            with socket.socket() as s:
                s.bind((pc.master_addr, 0))
                self.config = self.config.replace(parallel_config={"master_port": s.getsockname()[1]})
        self.packer = StepPacker()
        self._pending: deque[RemoteStep] = deque()  # steps sent with execute_model_async, replies not read yet
        self._failure: BaseException | None = None  # why the workers were stopped
        self.procs, self.conn = start_local_workers(self.config, self.hf_config)
        self._finalizer = weakref.finalize(self, _stop_at_exit, self.conn, self.procs)
        try:
            self._receive("init_device")  # rank 0 joined the group, so every rank did
            self.collective_rpc("load_model", self.config)  # other nodes take the engine's settings
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str | Callable, *args: Any, gather: bool = True) -> list[Any]:
        """Run method (a Worker method's name, or fn(worker, *args)) on every rank; each rank's result (rank
        0's only when gather is False). Steps still in flight are read back first."""
        self._read_pending_steps()
        self._send((method, args, gather))
        return self._receive(method, gather)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's output of the step, sent to every rank as a delta (step_wire)."""
        return self.collective_rpc("execute_step", self.packer.pack(scheduler_output), gather=False)[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "RemoteStep":
        """Send the step to the ranks without waiting for the steps before it; get() reads its reply."""
        self._send(("launch_step", (self.packer.pack(scheduler_output),), False))
        step = RemoteStep(self)
        self._pending.append(step)
        return step

    def _send(self, call: tuple | None) -> None:
        if self.conn is None:
            raise RuntimeError("the mp executor is shut down") from self._failure
        dead = self._first_dead(0.0)  # a rank that is gone already: name it, not the collective it breaks
        if dead is not None:
            self._raise_dead(dead)
        try:
            self.conn.send(call)
        except (BrokenPipeError, OSError):
            self._raise_dead(self._first_dead(1.0) or self.procs[0])

    def _read_pending_steps(self, until: "RemoteStep | None" = None) -> None:
        """Read the replies of launched steps, oldest first, up to `until` (all of them when None)."""
        while self._pending and (until is None or not until.done):
            try:
                output = self._receive("execute_step", gathered=False)[0]
            except Exception as exc:  # pending steps fail with it; a reply that could not be read leaves the
                self.shutdown(timeout=1.0, cause=exc)  # replies out of step, so the workers are stopped then too
                raise
            self._pending.popleft().finish(output)

    def _receive(self, method: str | Callable, gathered: bool = True) -> list[Any]:
        sentinels = {p.sentinel: p for p in self.procs}
        while True:
            ready = multiprocessing.connection.wait([self.conn, *sentinels])
            if self.conn in ready:
                try:
                    replies = self.conn.recv()
                except (EOFError, OSError):  # rank 0 closed the pipe (or died: a reset)
                    self._raise_dead(self._first_dead(1.0) or self.procs[0])
                break
            self._raise_dead(self._first_dead(0.0) or sentinels[ready[0]])
        for rank, ok, payload in replies:
            if ok:
                continue
            exc = RuntimeError(
                f"tensor-parallel worker rank={rank} failed in {getattr(method, '__name__', method)}:\n{payload}"
            )
            if not gathered:  # the other ranks' replies were not collected: they may be stuck in a collective
                dead = self._first_dead(0.5)  # a peer that died makes the others fail: name the peer
                if dead is not None:
                    self._raise_dead(dead)
                self.shutdown(timeout=1.0, cause=exc)
            raise exc
        return [payload for _, _, payload in replies]

    def _first_dead(self, grace: float):
        """The local worker that is gone (waiting up to grace seconds for one), killed by a signal first; None."""
        if not multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=grace):
            return None
        dead = [p for p in self.procs if not p.is_alive()]
        return min(dead, key=lambda p: (p.exitcode is not None and p.exitcode >= 0, p.tp_rank), default=None)

    def _raise_dead(self, proc) -> None:
        proc.join(1)
        exc = RuntimeError(
            f"tensor-parallel worker rank={proc.tp_rank} (pid {proc.pid}) died with exit code "
            f"{proc.exitcode}; the engine's workers were stopped"
        )
        self.shutdown(timeout=1.0, cause=exc)  # the survivors may be stuck in a collective with the dead rank
        raise exc

    def shutdown(self, timeout: float = 5.0, cause: BaseException | None = None) -> None:
        """Tell the ranks to stop (rank 0 broadcasts it), then make sure every local process is gone. Steps
        still in flight are not read: their get() raises cause (why the workers are stopped)."""
        if self.conn is None:
            return
        self._failure = cause or RuntimeError("the mp executor was shut down with this step in flight")
        for step in self._pending:
            step.finish(error=self._failure)
        self._pending.clear()
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.conn.close()
        self.conn = None
        stop_workers(self.procs, timeout)
        self._finalizer.detach()


def _stop_at_exit(conn: Any, procs: list) -> None:
    """An executor dropped or alive at interpreter exit: ask the ranks to stop, as shutdown() does, and wait
    for them. Killed instead, a rank would leave its semaphores (tqdm's lock) to the resource tracker's
    "leaked semaphore" warning, and print the tracebacks of its interrupted collectives."""
    try:
        conn.send(None)
        conn.close()
    except (BrokenPipeError, OSError):
        pass
    stop_workers(procs, 5.0)


class RemoteStep:
    """A step sent to the mp workers; get() reads the replies of the steps before it, then its own."""

    def __init__(self, executor: MultiprocExecutor):
        self._executor: MultiprocExecutor | None = executor
        self.done = False
        self._output: ModelRunnerOutput | None = None
        self._error: BaseException | None = None

    def finish(self, output: ModelRunnerOutput | None = None, error: BaseException | None = None) -> None:
        self._output, self._error, self.done, self._executor = output, error, True, None

    def get(self) -> ModelRunnerOutput:
        if not self.done:
            self._executor._read_pending_steps(until=self)
        if self._error is not None:
            raise self._error
        return self._output

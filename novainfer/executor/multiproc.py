"""The mp backend: one worker process per device over torch.distributed (NCCL on GPU, gloo on the CPU).

The driver (the engine's process) keeps no rank: it spawns this node's ranks, talks to rank 0 through a
pipe and watches every local process, so a worker that dies makes the next call raise, naming its rank,
instead of hanging in a collective. Ranks on other nodes are started there by `python -m
novainfer.executor.node_worker` with the same model and node_rank > 0; they follow rank 0's broadcasts.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import socket
import weakref
from typing import Any

import torch.multiprocessing as mp

from novainfer.config import EngineConfig
from novainfer.engine.scheduler import SchedulerOutput
from novainfer.executor.base import Executor
from novainfer.executor.step_wire import StepPacker
from novainfer.executor.worker_proc import run_worker
from novainfer.worker.model_runner import ModelRunnerOutput

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
        p = ctx.Process(target=run_worker, name=f"novainfer-tp-rank{rank}", daemon=True,
                        args=(child_conn, config, hf_config, rank, local_rank, logging.getLogger().getEffectiveLevel()))
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
            raise ValueError(f"node_rank={config.parallel_config.node_rank}: only node 0 runs the engine; "
                             "start the other nodes with `python -m novainfer.executor.node_worker`")
        self._init_executor()

    def _distributed_args(self) -> tuple[str, int, int]:
        """(distributed_init_method, rank, local_rank) of the first rank this executor starts."""
        return self.config.parallel_config.distributed_init_method, 0, 0

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        if pc.master_port == 0:  # one node: any free port on this machine
            with socket.socket() as s:
                s.bind((pc.master_addr, 0))
                pc.master_port = s.getsockname()[1]
        self.packer = StepPacker()
        self.procs, self.conn = start_local_workers(self.config, self.hf_config)
        self._finalizer = weakref.finalize(self, stop_workers, self.procs, 0.0)
        try:
            self._receive("init_device")  # rank 0 joined the group, so every rank did
            self.collective_rpc("load_model", self.config)  # other nodes take the engine's settings
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, *args: Any, gather: bool = True) -> list[Any]:
        """Run method on every rank; each rank's result (rank 0's only when gather is False)."""
        if self.conn is None:
            raise RuntimeError("the mp executor is shut down")
        try:
            self.conn.send((method, args, gather))
        except (BrokenPipeError, OSError):
            self._raise_dead(self.procs[0])
        return self._receive(method, gather)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's output of the step, sent to every rank as a delta (step_wire)."""
        return self.collective_rpc("execute_step", self.packer.pack(scheduler_output), gather=False)[0]

    def _receive(self, method: str, gathered: bool = True) -> list[Any]:
        sentinels = {p.sentinel: p for p in self.procs}
        while True:
            ready = multiprocessing.connection.wait([self.conn, *sentinels])
            if self.conn in ready:
                try:
                    replies = self.conn.recv()
                except EOFError:
                    self._raise_dead(self.procs[0])
                break
            self._raise_dead(sentinels[ready[0]])
        for rank, ok, payload in replies:
            if not ok:
                if not gathered:  # the other ranks' replies were not collected: they may be stuck in a collective
                    self.shutdown(timeout=1.0)
                raise RuntimeError(f"tensor-parallel worker rank={rank} failed in {method}:\n{payload}")
        return [payload for _, _, payload in replies]

    def _raise_dead(self, proc) -> None:
        proc.join(1)
        rank, pid, code = proc.tp_rank, proc.pid, proc.exitcode
        self.shutdown(timeout=1.0)  # the survivors may be stuck in a collective with the dead rank
        raise RuntimeError(f"tensor-parallel worker rank={rank} (pid {pid}) died with exit code {code}; "
                           "the engine's workers were stopped")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell the ranks to stop (rank 0 broadcasts it), then make sure every local process is gone."""
        if self.conn is None:
            return
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.conn.close()
        self.conn = None
        stop_workers(self.procs, timeout)
        self._finalizer.detach()

"""The uni backend: every rank in this process.

tp_size == 1: one worker called directly. tp_size > 1: one thread per rank, each with its own device
(device_ids[rank] on CUDA, the CPU otherwise), its own ThreadGroup rank (thread-local, so layers built
in that thread shard for it) and the shared in-process all-reduce. Torch releases the GIL in its kernels,
so ranks overlap. Decode CUDA graphs are off with tp_size > 1 (a thread barrier cannot be captured).
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any, Callable

from novainfer.config import EngineConfig
from novainfer.distributed.parallel_state import InProcessReducer, ThreadGroup
from novainfer.executor.base import Executor
from novainfer.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: Any):
        super().__init__(config, hf_config)
        self._init_executor()

    def _distributed_args(self) -> tuple[str, int, int]:
        """(distributed_init_method, rank, local_rank) of the first rank: no rendezvous in one process."""
        return "", 0, 0

    def _init_executor(self) -> None:
        tp = self.config.parallel_config.tensor_parallel_size
        init_method, rank, local_rank = self._distributed_args()
        if tp == 1:
            self.workers = [Worker(self.config, self.hf_config, rank, local_rank, init_method)]
            self.threads: list[ThreadPoolExecutor] = []
        else:
            self.reducer = InProcessReducer(tp)
            self.workers = [
                Worker(
                    self.config,
                    self.hf_config,
                    r,
                    r,
                    init_method,
                    is_driver_worker=r == 0,
                    group=ThreadGroup(r, tp, self.reducer),
                )
                for r in range(tp)
            ]
            self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"novainfer-tp{r}") for r in range(tp)]
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        def call(w: Worker) -> Callable:
            return getattr(w, method) if isinstance(method, str) else partial(method, w)

        if len(self.workers) == 1:
            return [call(self.workers[0])(*args)]
        if not self.threads:
            raise RuntimeError("the uni executor is shut down")
        futures: list[Future] = [t.submit(call(w), *args) for t, w in zip(self.threads, self.workers)]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:  # a rank failed: wake the ranks waiting for it at the all-reduce barrier
            self.reducer.barrier.abort()
            wait(pending)
        failures = [(rank, f.exception()) for rank, f in enumerate(futures) if f.exception() is not None]
        if failures:
            self.reducer.barrier.reset()
            # the rank that failed first, not the ones woken by the broken barrier
            rank, exc = next((f for f in failures if not isinstance(f[1], threading.BrokenBarrierError)), failures[0])
            exc.add_note(f"raised by tensor-parallel rank {rank} in {method} (uni backend)")
            raise exc
        return [f.result() for f in futures]

    def execute_model_async(self, scheduler_output):
        """One rank: launched on its runner, read back later; several ranks run it now."""
        if len(self.workers) == 1:
            return self.workers[0].model_runner.execute_model_async(scheduler_output)
        return super().execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        for t in self.threads:
            t.shutdown(wait=True)
        self.threads = []
        for w in self.workers:
            if w.model_runner is not None:
                w.model_runner.shutdown()

"""The interface the engine uses to run steps, whatever the number of workers and processes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from novainfer.config import EngineConfig
from novainfer.engine.scheduler import SchedulerOutput
from novainfer.worker.model_runner import ModelRunnerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig, hf_config: Any):
        self.config = config
        self.hf_config = hf_config

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from novainfer.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        if backend in ("mp", "ray"):
            raise NotImplementedError(f"distributed_executor_backend={backend!r} is not supported yet; use 'uni'")
        raise ValueError(f"distributed_executor_backend must be one of uni, mp, ray; got {backend!r}")

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call method on every worker and return each worker's result."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", scheduler_output)[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:  # noqa: B027 - executors with processes override it
        """Release workers; nothing to do for an in-process worker."""

"""The interface the engine uses to run steps, whatever the number of workers and processes."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable

from novainfer.config import EngineConfig
from novainfer.distributed import check_tp_divisibility
from novainfer.step_types import ModelRunnerOutput, SchedulerOutput, StepFuture

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Control plane: drives the workers (one per tensor-parallel rank); never touches the model's tensors."""

    def __init__(self, config: EngineConfig, hf_config: Any):
        self.config = config
        self.hf_config = hf_config
        pc = config.parallel_config
        # fail before any worker starts when the model is not supported or cannot be split (every rank would
        # fail the same way)
        from novainfer.models.registry import get_model_class

        get_model_class(hf_config)
        device = config.resolve_device()
        device_id = pc.tensor_parallel_device_ids[0] if device.type == "cuda" else device.type
        check_tp_divisibility(hf_config, pc.tensor_parallel_size, pc.rank, device_id)
        logger.info(
            "executor backend=%s tp_size=%d world_size=%d nnodes=%d device_ids=%s",
            pc.distributed_executor_backend,
            pc.tensor_parallel_size,
            pc.world_size,
            pc.nnodes,
            pc.tensor_parallel_device_ids,
        )

    @abstractmethod
    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        """Call method on every worker (all ranks together) and return each rank's result, in rank order.
        method: a Worker method's name, or a function called as method(worker, *args) (vLLM's form; with mp
        it is pickled by name, so it must be importable in the workers)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output is the canonical one."""
        return self.collective_rpc("execute_model", scheduler_output)[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Launch one step; its get() reads it back. Executors that cannot return before a step finishes
        run it here and hand back its output."""
        return DoneStep(self.execute_model(scheduler_output))

    def check_health(self) -> None:
        """Raise if a worker is gone or not initialised."""
        self.collective_rpc("check_health")

    def shutdown(self) -> None:  # noqa: B027 - executors with processes override it
        """Release workers; nothing to do for an in-process worker."""


class DoneStep:
    """A step that already ran: get() returns its output."""

    def __init__(self, output: ModelRunnerOutput):
        self.output = output

    def get(self) -> ModelRunnerOutput:
        return self.output

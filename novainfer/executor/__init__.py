"""Executors: how the engine's steps reach the workers (one process, or one process per rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from novainfer.config import EngineConfig
    from novainfer.executor.base import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor of config.parallel_config.distributed_executor_backend."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from novainfer.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from novainfer.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        raise NotImplementedError("distributed_executor_backend='ray' is not implemented; use 'uni' or 'mp'")
    raise ValueError(f"distributed_executor_backend must be one of uni, mp, ray; got {backend!r}")

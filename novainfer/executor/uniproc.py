"""One worker in this process."""
from __future__ import annotations

from typing import Any

from novainfer.config import EngineConfig
from novainfer.executor.base import Executor
from novainfer.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: Any):
        super().__init__(config, hf_config)
        self.worker = Worker(config, hf_config)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

"""A Worker owns one device: it loads the model there, sizes and holds the KV cache, runs steps."""
from __future__ import annotations

import logging
import os

import torch

from novainfer.config import EngineConfig
from novainfer.engine.scheduler import SchedulerOutput
from novainfer.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, hf_config, rank: int = 0):
        self.config = config
        self.hf_config = hf_config
        self.rank = rank
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = self.config.resolve_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.model_config.seed)
        logger.info("worker pid=%d rank=%d device=%s", os.getpid(), self.rank, self.device)

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config, self.hf_config, self.device)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks)
        self.model_runner.capture_cudagraphs()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        if self.model_runner is None or self.model_runner.kv_cache is None:
            raise RuntimeError(f"worker rank {self.rank} is not initialised")

"""A Worker owns one device and one tensor-parallel rank: it loads its shard of the model there, sizes
and holds its KV cache (local_nkvh heads), runs steps. Executors drive workers; workers never schedule."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from novainfer.config import EngineConfig
from novainfer.distributed import TPGroup, check_tp_divisibility, set_tp_group
from novainfer.step_types import DraftRequest, ModelRunnerOutput, SchedulerOutput
from novainfer.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str = "",
        is_driver_worker: bool = True,
        group: TPGroup | None = None,
    ):
        self.config = config
        self.hf_config = hf_config
        self.rank, self.local_rank = rank, local_rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker  # rank 0: its output is the step's canonical result
        self.group = group  # None: built by init_device (torch.distributed for mp, one rank otherwise)
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        """Bind this rank's device (device_ids[local_rank] on CUDA) and make its group current in this thread."""
        pc = self.config.parallel_config
        device = self.config.resolve_device()
        if device.type == "cuda":
            ids, count = pc.tensor_parallel_device_ids, torch.cuda.device_count()
            if ids[self.local_rank] >= count:
                raise ValueError(
                    f"tensor_parallel_device_ids={ids}: rank {self.rank} wants cuda:{ids[self.local_rank]}"
                    f" but this machine has {count} CUDA device(s)"
                )
            device = torch.device("cuda", ids[self.local_rank])
            torch.cuda.set_device(device)
        self.device = device
        if self.group is None:
            self.group = self._init_distributed() if pc.tensor_parallel_size > 1 else TPGroup()
        set_tp_group(self.group, process_wide=not pc.use_single_process_tp)
        torch.manual_seed(self.config.model_config.seed)
        logger.info(
            "worker pid=%d rank=%d local_rank=%d device=%s tp_size=%d backend=%s",
            os.getpid(),
            self.rank,
            self.local_rank,
            device,
            pc.tensor_parallel_size,
            pc.distributed_executor_backend,
        )

    def _init_distributed(self) -> TPGroup:
        from datetime import timedelta

        import torch.distributed as dist

        from novainfer.distributed.parallel_state import TorchDistGroup

        pc = self.config.parallel_config
        backend = pc.distributed_backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=self.distributed_init_method or pc.distributed_init_method,
            world_size=pc.world_size,
            rank=self.rank,
            timeout=timedelta(seconds=600),
        )
        return TorchDistGroup()

    def load_model(self, config: EngineConfig | None = None) -> None:
        """Check that the model splits over tp_size, then build this rank's shard of it on the device.

        config: the engine's, sent by the driver so ranks on other nodes use its model, cache and
        scheduler settings (block size, dtype...); this node's parallel_config is kept."""
        if config is not None:
            self.config = dataclasses.replace(config, parallel_config=self.config.parallel_config)
            self.hf_config = config.model_config.hf_config
        tp = self.config.parallel_config.tensor_parallel_size
        check_tp_divisibility(self.hf_config, tp, self.rank, str(self.device))
        self.model_runner = ModelRunner(self.config, self.hf_config, self.device)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit on this rank (after a profiling forward on CUDA); the engine takes the minimum."""
        return self.model_runner.determine_num_blocks()

    def profile(self) -> dict:
        """What this rank holds: its place, its device, its KV heads and cache size."""
        runner = self.model_runner
        layer = runner.attention_layers()[0]
        return dict(
            rank=self.rank,
            local_rank=self.local_rank,
            device=str(self.device),
            pid=os.getpid(),
            tp_size=self.group.size,
            local_num_heads=layer.num_heads,
            local_num_kv_heads=layer.num_kv_heads,
            num_blocks=runner.num_blocks,
            kv_bytes_per_block=runner.kv_bytes_per_block(),
        )

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks)
        self.model_runner.warm_up_kernels()
        pc = self.config.parallel_config
        # uni ranks are threads meeting at a barrier, which a CUDA graph cannot capture: they run eager
        if pc.use_single_process_tp and pc.tensor_parallel_size > 1:
            return
        try:
            self.model_runner.capture_cudagraphs()
        except Exception:  # e.g. a collective this torch/NCCL cannot capture: slower, still correct
            if pc.tensor_parallel_size == 1:
                raise
            logger.exception(
                "rank %d: CUDA graph capture failed with tp_size=%d; decoding eagerly",
                self.rank,
                pc.tensor_parallel_size,
            )
            self.model_runner.graphs = None
            torch.cuda.synchronize(self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch one step; the handle's get() waits for it and returns its output (async scheduling)."""
        return self.model_runner.execute_model_async(scheduler_output)

    def propose_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        """The draft model's greedy guesses for each request (speculative_config method draft_model)."""
        drafter = self.model_runner.drafter
        if drafter is None:
            raise RuntimeError("propose_draft_tokens needs speculative_config with method 'draft_model'")
        return drafter.propose(requests)

    def check_health(self) -> None:
        if self.model_runner is None or self.model_runner.kv_cache is None:
            raise RuntimeError(f"worker rank {self.rank} (local_rank {self.local_rank}) is not initialised")

    def shutdown(self) -> None:
        """Free the runner's caches and leave the torch.distributed group, if this worker joined one."""
        import torch.distributed as dist

        if self.model_runner is not None:
            self.model_runner.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

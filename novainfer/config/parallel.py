"""ParallelConfig: how the model is spread over devices and processes, and the checks on it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from novainfer.config.fields import derived, setting

EXECUTOR_BACKENDS = ("uni", "mp")
RAY_REFUSED = (
    "distributed_executor_backend='ray' is not implemented; use 'uni' (one process) or 'mp' (one process per device)"
)


def _executor_backend(text: str) -> str:
    """--distributed-executor-backend's value; 'ray' (vLLM's) is refused by name, not as an unknown choice."""
    if text == "ray":
        raise ValueError(RAY_REFUSED)
    return text


def _int_list(text: str) -> list[int]:
    """A comma-separated list of integers, as --tensor-parallel-device-ids takes it."""
    return [int(x) for x in text.split(",")]


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices (vLLM's names first).

    world_size, rank and local_rank describe this process's place; normalize_parallel_config fills them.
    distributed_backend "auto" means nccl on CUDA and gloo on the CPU (the seed fixes nccl: it has no CPU path).
    """

    pipeline_parallel_size: int = setting(1, "pipeline stages (only 1)", cli=False)
    tensor_parallel_size: int = setting(1, "ranks each layer is split over", short="-tp")
    data_parallel_size: int = setting(
        1, "refused above 1: run one server per replica behind a router (docs/DEPLOY.md)", short="-dp"
    )
    distributed_executor_backend: str = setting(
        "uni",
        "uni: every rank in this process; mp: one process per device (torch.distributed)",
        choices=EXECUTOR_BACKENDS,
        type=_executor_backend,
    )
    master_addr: str = setting("127.0.0.1", "mp: address of node 0 for the rendezvous")
    master_port: int = setting(29501, "mp: port of node 0 for the rendezvous (0: any free port, one node only)")
    node_rank: int = setting(0, "mp: this machine's index (0 runs the engine)")
    nnodes: int = setting(1, "mp: machines the ranks span")
    world_size: int = derived(1)
    rank: int = derived(0)
    local_rank: int = derived(0)
    # NovaInfer's additions (not vLLM fields)
    distributed_backend: str = setting(
        "auto", "torch.distributed backend (auto: nccl on CUDA, gloo on the CPU)", choices=("auto", "nccl", "gloo")
    )
    init_method: str = setting("", "torch.distributed init method ('': tcp://master_addr:master_port)", cli=False)
    tp_group_name: str = setting("TP0", "name of the tensor-parallel group", cli=False)
    use_single_process_tp: bool = derived(True, "True for uni")
    tensor_parallel_device_ids: list[int] | None = setting(
        None, "comma-separated CUDA device ids of this node's ranks", type=_int_list, shown="0..n-1"
    )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def distributed_init_method(self) -> str:
        return self.init_method or f"tcp://{self.master_addr}:{self.master_port}"


def normalize_parallel_config(cfg: ParallelConfig) -> ParallelConfig:
    """cfg with its derived fields filled; impossible layouts are refused, each error naming the field."""
    if cfg.distributed_executor_backend == "ray":
        raise NotImplementedError(RAY_REFUSED)
    if cfg.distributed_executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {cfg.distributed_executor_backend!r}"
        )
    if cfg.data_parallel_size != 1:
        raise ValueError(
            f"data_parallel_size={cfg.data_parallel_size}: not supported; run one `novainfer serve` per "
            "replica behind a router (sglang-router, vllm-router, llm-d): see docs/DEPLOY.md"
        )
    if int(cfg.tensor_parallel_size) < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {cfg.tensor_parallel_size}")
    if cfg.pipeline_parallel_size != 1:
        raise NotImplementedError(f"pipeline_parallel_size must be 1, got {cfg.pipeline_parallel_size}")
    if cfg.distributed_backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"distributed_backend must be auto, nccl or gloo, got {cfg.distributed_backend!r}")
    tp = int(cfg.tensor_parallel_size)
    if cfg.nnodes < 1 or tp % cfg.nnodes:
        raise ValueError(f"nnodes={cfg.nnodes} must be >= 1 and divide tensor_parallel_size={tp}")
    if cfg.nnodes > 1 and cfg.distributed_executor_backend != "mp":
        raise ValueError(
            f"nnodes={cfg.nnodes} needs distributed_executor_backend='mp', got {cfg.distributed_executor_backend!r}"
        )
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={cfg.nnodes}), got {cfg.node_rank}")
    if not 0 <= cfg.master_port < 65536 or (cfg.master_port == 0 and cfg.nnodes > 1):
        raise ValueError(f"master_port must be in 1..65535 (0: a free port, one node only), got {cfg.master_port}")
    local = tp // cfg.nnodes
    ids = list(range(local)) if cfg.tensor_parallel_device_ids is None else list(cfg.tensor_parallel_device_ids)
    if len(ids) != local:
        raise ValueError(
            f"tensor_parallel_device_ids={ids} has length {len(ids)}, expected {local} "
            f"(tensor_parallel_size={tp} over nnodes={cfg.nnodes})"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"tensor_parallel_device_ids={ids} contains duplicates")
    if any(int(i) < 0 for i in ids):
        raise ValueError(f"tensor_parallel_device_ids={ids} contains a negative id")
    return dataclasses.replace(
        cfg,
        tensor_parallel_size=tp,
        tensor_parallel_device_ids=[int(i) for i in ids],
        world_size=tp * cfg.pipeline_parallel_size,
        rank=cfg.node_rank * local,  # this process's first rank; each worker gets its own
        local_rank=0,
        use_single_process_tp=cfg.distributed_executor_backend == "uni",
    )

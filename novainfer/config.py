"""Engine configuration: every knob the engine reads comes from these dataclasses (vLLM's names)."""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from novainfer.engine.faults import FaultInjector

if TYPE_CHECKING:  # torch is imported where tensors are made (the engine core), never by the server's front-end
    import torch

# Files the engine builds once and reuses across runs: the CPU kernels' shared library (keyed by its sources'
# hash) and tokenizers converted from GGUF files (keyed by the file and the transformers version).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "novainfer")


@dataclass
class ModelConfig:
    """Where the model lives and how its tensors are laid out."""

    model: str
    hf_config: Any = None  # transformers.PretrainedConfig, filled by the loader
    dtype: torch.dtype | None = None  # None: bfloat16 on GPU; on CPU bfloat16 with AVX512-BF16/AMX, else float32
    quantization: str | None = None  # None (auto): GGUF blocks stay quantized on the CPU unless dtype=float32
    # is given; "gguf": keep them quantized on the CPU; "none": dequantize (today's exact path); "fp8" (vLLM's
    # dynamic FP8): dense linear weights quantized to float8 at load (layers/quantization/fp8.py)
    cpu_decode_stack: bool = True  # on the quantized CPU path, a decode step's whole decoder stack runs in one C
    # call (layers/quantization/cpu_decoder.py; same result to the bit); False: layer by layer from Python
    gpu_decode_stack: bool = True  # on CUDA, a one-token decode step runs each llama-family layer as five fused
    # kernels (layers/gpu_decoder.py); False: the layer-by-layer kernels
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    tokenizer: str | None = None
    seed: int = 0
    # "auto": the weights in the folder or GGUF file; "dummy" (vLLM's): a config-only folder, the weights
    # initialised randomly in place (for benchmarks of shapes too large to write to disk)
    load_format: str = "auto"

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """dtype as a torch.dtype: from_kwargs keeps dtype as a checked name ("float32"), so that building a
        config never imports torch (the server's front-end); read dtype through this (None: the default)."""
        return to_torch_dtype(self.dtype)


@dataclass
class CacheConfig:
    """Paged KV cache: block size, how many blocks, prefix caching."""

    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: sized from free memory (GPU) or cpu_kv_cache_tokens (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_tokens: int = 32768  # CPU KV capacity (--cpu-kv-cache-tokens); 32k bf16 tokens of the
    # default model are 0.75 GB, inside the 1.5 GB serve budget
    cache_dtype: str = "auto"  # auto: the model's dtype, bfloat16 on the CPU unless dtype=float32 is given
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    """Batching limits for one engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: vLLM's offline default, 16384 on one CUDA GPU of >= 70 GiB
    # other than an A100, else 8192 (EngineConfig.resolve_token_budget; the server's CLI passes 8192)
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: on with CUDA, off on the CPU


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer guesses up to num_speculative_tokens
    tokens per sequence and one target forward checks them all (spec_decode/)."""

    method: str = "ngram"  # "ngram" (prompt lookup, no extra model) or "draft_model"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int = 3  # ngram: longest suffix n-gram tried first
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer/vocabulary as the target)
    disable_by_batch_size: int | None = None  # no guesses while this many sequences or more are running

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """From a dict (or a JSON string from the command line); unknown keys are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft checkpoint) is required for method 'draft_model'")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is only used by method 'draft_model'")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a step's tokens that the proposer writes (a draft model's guesses), per sequence."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass
class ParallelConfig:
    """How the model is spread over devices: seed 000 §5.1's fields, in its order (vLLM's names first).

    world_size, rank and local_rank describe this process's place; normalize_parallel_config fills them.
    distributed_backend "auto" means nccl on CUDA and gloo on the CPU (the seed fixes nccl: it has no CPU path).
    """

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # uni (one process), mp (one process per device), ray (refused)
    master_addr: str = "127.0.0.1"
    master_port: int = 29501  # 0: any free port (one node only)
    node_rank: int = 0
    nnodes: int = 1
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    # NovaInfer's additions (not vLLM fields)
    distributed_backend: str = "auto"  # auto, nccl, gloo
    init_method: str = ""  # "" means tcp://master_addr:master_port
    tp_group_name: str = "TP0"
    use_single_process_tp: bool = True  # derived: True for uni
    tensor_parallel_device_ids: list[int] | None = None  # this node's CUDA device per local rank

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def distributed_init_method(self) -> str:
        return self.init_method or f"tcp://{self.master_addr}:{self.master_port}"


def normalize_parallel_config(cfg: ParallelConfig) -> ParallelConfig:
    """Fill the derived fields and reject impossible layouts; every error names the field and its value."""
    backends = ("uni", "mp", "ray")
    if cfg.distributed_executor_backend not in backends:
        raise ValueError(f"distributed_executor_backend must be one of {backends}, "
                         f"got {cfg.distributed_executor_backend!r}")
    if cfg.distributed_executor_backend == "ray":
        raise NotImplementedError("distributed_executor_backend='ray' is not implemented; "
                                  "use 'uni' (one process) or 'mp' (one process per device)")
    if int(cfg.tensor_parallel_size) < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {cfg.tensor_parallel_size}")
    if cfg.pipeline_parallel_size != 1:
        raise NotImplementedError(f"pipeline_parallel_size must be 1, got {cfg.pipeline_parallel_size}")
    if cfg.distributed_backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"distributed_backend must be auto, nccl or gloo, got {cfg.distributed_backend!r}")
    cfg.tensor_parallel_size = int(cfg.tensor_parallel_size)
    if cfg.nnodes < 1 or cfg.tensor_parallel_size % cfg.nnodes:
        raise ValueError(f"nnodes={cfg.nnodes} must be >= 1 and divide tensor_parallel_size="
                         f"{cfg.tensor_parallel_size}")
    if cfg.nnodes > 1 and cfg.distributed_executor_backend != "mp":
        raise ValueError(f"nnodes={cfg.nnodes} needs distributed_executor_backend='mp', "
                         f"got {cfg.distributed_executor_backend!r}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={cfg.nnodes}), got {cfg.node_rank}")
    if not 0 <= cfg.master_port < 65536 or (cfg.master_port == 0 and cfg.nnodes > 1):
        raise ValueError(f"master_port must be in 1..65535 (0: a free port, one node only), got {cfg.master_port}")
    local = cfg.ranks_per_node
    if cfg.tensor_parallel_device_ids is None:
        cfg.tensor_parallel_device_ids = list(range(local))
    ids = list(cfg.tensor_parallel_device_ids)
    if len(ids) != local:
        raise ValueError(f"tensor_parallel_device_ids={ids} has length {len(ids)}, expected {local} "
                         f"(tensor_parallel_size={cfg.tensor_parallel_size} over nnodes={cfg.nnodes})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"tensor_parallel_device_ids={ids} contains duplicates")
    if any(int(i) < 0 for i in ids):
        raise ValueError(f"tensor_parallel_device_ids={ids} contains a negative id")
    cfg.tensor_parallel_device_ids = [int(i) for i in ids]
    cfg.world_size = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    cfg.rank = cfg.node_rank * local  # this process's first rank; each worker gets its own
    cfg.local_rank = 0
    cfg.use_single_process_tp = cfg.distributed_executor_backend == "uni"
    return cfg


@dataclass
class EngineConfig:
    """Everything the engine needs, built once from the user's keyword arguments."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs
    trim_heap_when_idle: bool = True  # the engine core process returns the C heap's free pages (its last steps'
    # workspaces) to the system whenever it goes idle (engine/malloc_heap.py)
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu elsewhere), cpu, torch, triton
    fault_injection: str | None = None  # tests only: "STAGE:REQUEST_ID_PREFIX" (engine/faults.py); off in production
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_events_config: Any = None  # engine/kv_events.py's KVEventsConfig (--kv-events-config); None: no KV events

    @classmethod
    def from_kwargs(cls, model: str, **kw: Any) -> "EngineConfig":
        """Split vLLM-style flat keyword arguments into the config sections."""
        sections = {"model_config": ModelConfig, "cache_config": CacheConfig,
                    "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig}
        parts: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        for key, value in kw.items():
            owner = next((n for n, c in sections.items() if key in c.__dataclass_fields__), None)
            if owner is not None:
                parts[owner][key] = value
            elif key in ("device", "enforce_eager", "attention_backend", "fault_injection", "trim_heap_when_idle"):
                top[key] = value
            elif key == "speculative_config":
                top[key] = SpeculativeConfig.from_value(value)
            elif key == "kv_events_config":
                from novainfer.engine.kv_events import KVEventsConfig
                top[key] = KVEventsConfig.from_value(value)
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        dtype = parts["model_config"].get("dtype")
        if isinstance(dtype, str):
            parts["model_config"]["dtype"] = _parse_dtype(dtype)
        cfg = cls(model_config=ModelConfig(model=model, **parts["model_config"]),
                  cache_config=CacheConfig(**parts["cache_config"]),
                  scheduler_config=SchedulerConfig(**parts["scheduler_config"]),
                  parallel_config=ParallelConfig(**parts["parallel_config"]), **top)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject values that can never work, naming the field."""
        c, s, p = self.cache_config, self.scheduler_config, self.parallel_config
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if c.block_size <= 0 or c.block_size & (c.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {c.block_size}")
        if c.cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"cache_dtype must be auto, float32, bfloat16 or float16, got {c.cache_dtype!r}")
        if self.model_config.quantization not in (None, "gguf", "fp8", "none"):
            raise ValueError(f"quantization must be gguf, fp8 or none, got {self.model_config.quantization!r}")
        if self.model_config.quantization == "fp8" and self.model_config.is_gguf:
            raise ValueError("quantization='fp8' quantizes a bf16/fp16 checkpoint at load; a GGUF file is quantized "
                             "already (use quantization='gguf' or 'none')")
        if c.cpu_kv_cache_tokens < 1:
            raise ValueError(f"cpu_kv_cache_tokens must be >= 1, got {c.cpu_kv_cache_tokens}")
        if s.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {s.max_num_seqs}")
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}")
        normalize_parallel_config(p)
        if self.model_config.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.model_config.load_format!r}")
        FaultInjector(self.fault_injection)  # a malformed spec fails here, not mid-step
        sc = self.speculative_config
        if sc is not None:
            sc.validate()
            if p.distributed_executor_backend != "uni":  # the mp step wire does not carry guesses
                raise ValueError("speculative_config needs distributed_executor_backend='uni'")
            if sc.method == "draft_model" and p.tensor_parallel_size > 1:
                raise ValueError("speculative_config.method 'draft_model' needs tensor_parallel_size=1")

    def use_async_scheduling(self) -> bool:
        """Overlap on by default on CUDA, off on the CPU (measured: benchmarks/host_overhead.py). Executors that
        return a step before it finishes: uni with one rank, and mp with any number of ranks and nodes (its
        workers pipeline steps, executor/step_pipeline.py). uni with tp_size > 1 runs each step to the end."""
        pc = self.parallel_config
        wanted = self.scheduler_config.async_scheduling
        if self.speculative_config is not None:  # proposals need the step's tokens first (spec_decode/)
            if wanted:
                logging.getLogger(__name__).warning("async_scheduling is off with speculative decoding")
            return False
        if wanted is None:
            wanted = self.resolve_device().type == "cuda"
        if wanted and pc.tensor_parallel_size > 1 and pc.distributed_executor_backend == "uni":
            if self.scheduler_config.async_scheduling:
                logging.getLogger(__name__).warning(
                    "async_scheduling is off with the uni backend and tensor_parallel_size > 1 (its ranks are "
                    "threads that run each step to the end); distributed_executor_backend='mp' overlaps")
            return False
        return wanted

    def resolve_token_budget(self) -> int:
        """max_num_batched_tokens as given, else (set here, once) vLLM's default for offline use: 16384 on a
        CUDA GPU of >= 70 GiB other than an A100 (H100, H200: the 7B bench shape in fp8 measured 13.8-13.9k
        against 12.8-13.7k tok/s at 8192 on one H200), else 8192. Only with one rank in the engine's process,
        which initializes CUDA anyway; called there, before the step loop's buffers are sized."""
        s = self.scheduler_config
        if s.max_num_batched_tokens is None:
            s.max_num_batched_tokens = 8192
            p = self.parallel_config
            if (p.tensor_parallel_size == 1 and p.distributed_executor_backend == "uni"
                    and self.resolve_device().type == "cuda"):
                import torch
                props = torch.cuda.get_device_properties(self.resolve_device())
                if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
                    s.max_num_batched_tokens = 16384
        return s.max_num_batched_tokens

    def resolve_device(self) -> torch.device:
        """'auto' picks CUDA when present; NOVAINFER_DEVICE overrides (documented in the README)."""
        import torch
        name = self._device_name()
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device

    def may_use_cuda(self) -> bool:
        """Whether resolve_device() can give CUDA, answered without importing torch (the server's front-end,
        which never imports it, picks the engine core's start method by it). A named device answers; for
        'auto', torch's own answer where torch is loaded already, else whether the installed torch is a CUDA
        build and the CUDA driver library loads: at worst a yes where torch would find no GPU (the core is then
        spawned, which works everywhere, only slower to start)."""
        name = self._device_name()
        if name != "auto":
            return name.split(":")[0] == "cuda"
        if "torch" in sys.modules:
            return sys.modules["torch"].cuda.is_available()
        return _torch_has_cuda_build() and _cuda_driver_loads()

    def _device_name(self) -> str:
        return os.environ.get("NOVAINFER_DEVICE", self.device)


def _torch_has_cuda_build() -> bool:
    """torch/version.py's `cuda` is set (read as text: importing torch is what this avoids)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return True  # unknown: say yes (the core is then spawned, which works on every device)
    values = re.findall(r"^cuda\s*(?::[^=]*)?=\s*(.+?)\s*$", text, re.M)
    return any(v != "None" for v in values)


def _cuda_driver_loads() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def default_cpu_dtype() -> torch.dtype:
    """A dense CPU model's dtype when none was asked for: bfloat16 where the CPU multiplies it natively
    (AVX512-BF16 or AMX), float32 elsewhere (a quantization config's activation_dtype comes first)."""
    import torch
    from novainfer.layers.quantization.cpu_kernels import cpu_flags
    return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32


def resolve_cache_dtype(cfg: EngineConfig, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: as asked, else the model's; bfloat16 on the CPU unless float32 was asked for."""
    import torch
    name = cfg.cache_config.cache_dtype
    if name != "auto":
        return to_torch_dtype(name)
    if device.type == "cpu" and cfg.model_config.dtype is None:
        return torch.bfloat16
    return model_dtype


_DTYPE_NAMES = {"auto": None, "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                "bfloat16": "bfloat16"}


def _parse_dtype(name: str) -> str | None:
    """A dtype name checked and made canonical ("half" -> "float16"; "auto" -> None), without torch."""
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {name!r}")
    return _DTYPE_NAMES[name]


def to_torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype name (or a torch.dtype, returned as is) as a torch.dtype; None stays None."""
    if not isinstance(dtype, str):
        return dtype
    name = _parse_dtype(dtype)
    if name is None:
        return None
    import torch
    return getattr(torch, name)


@dataclass
class ServerConfig:
    """The HTTP server's knobs (`novainfer serve` flags); the engines have their own EngineConfig."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never printed; see resolve_api_key
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser), as vLLM's flag
    tool_call_parser: str | None = None  # server/tool_parsers: hermes (Qwen2.5/Qwen3), llama3_json
    max_concurrent_requests: int = 256  # generation requests in flight at once
    max_queue_len: int = 512  # requests waiting for a slot; past it: 429
    max_sessions: int = 1024  # session_id histories kept (least recently used dropped)
    session_ttl: float = 3600.0  # seconds an idle session is kept
    retry_after: int = 1  # seconds, sent with 429
    max_request_body_bytes: int = 4 << 20  # larger bodies get 413 before they are parsed
    allowed_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are given
    shutdown_timeout: float = 10.0  # on SIGTERM, seconds in-flight requests may finish before they are aborted
    drain_delay: float = 0.0  # on SIGTERM, seconds /ready answers 503 while requests are still taken, then drain

    @staticmethod
    def resolve_api_key(flag: str | None, key_file: str | None) -> str | None:
        """The API key from --api-key, else --api-key-file (its first line), else the NOVAINFER_API_KEY
        environment variable (documented in the README): the last two keep it out of `ps`."""
        if flag:
            return flag
        if key_file:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
            if not key:
                raise ValueError(f"--api-key-file {key_file} is empty")
            return key
        return os.environ.get("NOVAINFER_API_KEY") or None

"""EngineConfig: every section the engine reads, built once from vLLM-style flat keyword arguments, checked,
and frozen (a later change is a dataclasses.replace, never an assignment)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from novainfer.config.cache import FP8_CACHE_DTYPES, CacheConfig
from novainfer.config.fields import setting
from novainfer.config.kv_events import KVEventsConfig
from novainfer.config.model import QUANTIZATIONS, ModelConfig, _parse_dtype, to_torch_dtype
from novainfer.config.parallel import ParallelConfig, normalize_parallel_config
from novainfer.config.scheduler import SchedulerConfig
from novainfer.config.speculative import SpeculativeConfig
from novainfer.platform import cuda_driver_loads, torch_has_cuda_build

if TYPE_CHECKING:
    import torch

# the sections whose fields are flat engine arguments, in the order --help lists them
SECTIONS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built once from the user's keyword arguments."""

    model_config: ModelConfig
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    device: str = setting(
        "auto",
        "auto (CUDA when present, else the CPU), cpu, cuda or cuda:N; the "
        "NOVAINFER_DEVICE environment variable overrides it",
    )
    enforce_eager: bool = setting(False, "no CUDA graphs")
    trim_heap_when_idle: bool = setting(
        True,
        "the engine core process gives its freed step workspaces back to the system when it goes idle "
        "(glibc malloc_trim)",
    )
    attention_backend: str = setting(
        "auto", "auto: triton on CUDA, cpu elsewhere", choices=("auto", "cpu", "torch", "triton")
    )
    batch_invariant: bool = setting(
        False,
        "CUDA: a request gets the same bits alone or in any batch (fixed GEMM and attention tiles, no batch-sized "
        "split-K; vLLM's VLLM_BATCH_INVARIANT), at a throughput cost; the CPU's bf16 and quantized paths are "
        "batch-invariant without it",
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        'speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}',
        type=SpeculativeConfig.from_value,
        shown="off",
    )
    kv_events_config: KVEventsConfig | None = setting(
        None,
        'publish KV-cache events as vLLM does, JSON: \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (docs/DEPLOY.md)',
        type=KVEventsConfig.from_value,
        shown="off",
    )

    @classmethod
    def from_kwargs(cls, model: str | None, **kw: Any) -> "EngineConfig":
        """Split vLLM-style flat keyword arguments (the sections' and this class's settings) into the config
        sections; checked and frozen."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        top: dict[str, Any] = {}
        owners = {f.name: (section, f) for section, f in engine_arg_fields()}
        # a field's flag is vLLM's name of it (kv_cache_dtype for cache_dtype): taken as a keyword argument too
        owners |= {f.metadata["flag"].replace("-", "_"): (s, f) for s, f in owners.values() if f.metadata.get("flag")}
        for key, value in kw.items():
            if key not in owners:
                if key in _DERIVED:
                    raise TypeError(f"engine argument {key!r} is derived by the engine, not set")
                raise TypeError(f"unknown engine argument {key!r}")
            section, f = owners[key]
            target = parts[section] if section else top
            if f.name in target:
                raise TypeError(f"engine argument {f.name!r} given twice (as {key!r} too)")
            target[f.name] = value
        dtype = parts["model_config"].get("dtype")
        if isinstance(dtype, str):
            parts["model_config"]["dtype"] = _parse_dtype(dtype)
        if "speculative_config" in top:
            top["speculative_config"] = SpeculativeConfig.from_value(top["speculative_config"])
        if "kv_events_config" in top:
            top["kv_events_config"] = KVEventsConfig.from_value(top["kv_events_config"])
        parallel = normalize_parallel_config(ParallelConfig(**parts["parallel_config"]))
        cfg = cls(
            model_config=ModelConfig(model=model, **parts["model_config"]),
            cache_config=CacheConfig(**parts["cache_config"]),
            scheduler_config=SchedulerConfig(**parts["scheduler_config"]),
            parallel_config=parallel,
            **top,
        )
        cfg.validate()
        return cfg

    def replace(self, **sections: Any) -> "EngineConfig":
        """This config with some sections' fields changed: replace(model_config={"model": path})."""
        changes = {
            name: dataclasses.replace(getattr(self, name), **fields) if isinstance(fields, dict) else fields
            for name, fields in sections.items()
        }
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Reject values that can never work, naming the field."""
        mc, p = self.model_config, self.parallel_config
        self.cache_config.validate()
        self.scheduler_config.validate()
        if mc.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be gguf, fp8 or none, got {mc.quantization!r}")
        if mc.quantization == "fp8" and mc.is_gguf:
            raise ValueError(
                "quantization='fp8' quantizes a bf16/fp16 checkpoint at load; a GGUF file is quantized "
                "already (use quantization='gguf' or 'none')"
            )
        if mc.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {mc.load_format!r}")
        if self.batch_invariant and (mc.quantization == "fp8" or p.tensor_parallel_size > 1):
            raise ValueError(
                "batch_invariant runs unquantized weights on one rank (fp8 GEMMs and the all-reduce pick their "
                "algorithm by batch size)"
            )
        kept_quantized = mc.quantization != "none" and not (mc.quantization is None and mc.dtype == "float32")
        if self.batch_invariant and mc.is_gguf and kept_quantized and self.may_use_cuda():
            raise ValueError(
                "batch_invariant with a GGUF model on a GPU: its quantized kernels pick their algorithm by batch "
                "size; pass quantization='none' (weights dequantized) or dtype='float32'"
            )
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
                    "threads that run each step to the end); distributed_executor_backend='mp' overlaps"
                )
            return False
        return wanted

    def resolve_token_budget(self) -> int:
        """max_num_batched_tokens as given, else vLLM's default for offline use: 16384 on a CUDA GPU of
        >= 70 GiB other than an A100 (H100, H200: the 7B bench shape in fp8 measured 13.8-13.9k against
        12.8-13.7k tok/s at 8192 on one H200), else 8192. The 16384 only with one rank in the engine's process,
        which initializes CUDA anyway; with_token_budget() stores the answer."""
        s = self.scheduler_config
        if s.max_num_batched_tokens is not None:
            return s.max_num_batched_tokens
        p = self.parallel_config
        if (
            p.tensor_parallel_size == 1
            and p.distributed_executor_backend == "uni"
            and self.resolve_device().type == "cuda"
        ):
            import torch

            props = torch.cuda.get_device_properties(self.resolve_device())
            if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
                return 16384
        return 8192

    def with_token_budget(self) -> "EngineConfig":
        """This config with max_num_batched_tokens resolved (the engine core calls it once, before the step
        loop's buffers are sized)."""
        return self.replace(scheduler_config={"max_num_batched_tokens": self.resolve_token_budget()})

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
        return torch_has_cuda_build() and cuda_driver_loads()

    def _device_name(self) -> str:
        return os.environ.get("NOVAINFER_DEVICE", self.device)


def engine_arg_fields() -> Iterator[tuple[str | None, dataclasses.Field]]:
    """(section name or None for EngineConfig's own, field) of every flat engine argument, in --help order."""
    for name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            if f.name != "model" and not f.metadata.get("derived"):
                yield name, f
    for f in dataclasses.fields(EngineConfig):
        if f.name not in SECTIONS:
            yield None, f


_DERIVED = {f.name for section in SECTIONS.values() for f in dataclasses.fields(section) if f.metadata.get("derived")}


def resolve_cache_dtype(cfg: EngineConfig, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: as asked, else the model's; bfloat16 on the CPU unless float32 was asked for. An fp8
    cache is refused where the CPU attention backend would read it, and for Triton on a GPU older than sm_89."""
    import torch

    name = cfg.cache_config.cache_dtype
    if name in FP8_CACHE_DTYPES:
        backend = cfg.attention_backend
        if backend == "cpu" or (backend == "auto" and device.type != "cuda"):
            raise ValueError(
                f"kv_cache_dtype={name!r} needs the Triton attention backend (the CPU attention kernels read a "
                "bfloat16 or float32 cache); use kv_cache_dtype=auto on the CPU"
            )
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" and backend != "torch" else None
        if cap is not None and cap < (8, 9):  # Triton converts to and from e4m3 on Ada/Hopper and newer only
            raise ValueError(
                f"kv_cache_dtype={name!r} needs an NVIDIA GPU of compute capability 8.9 or newer; this is "
                f"sm_{cap[0]}{cap[1]}"
            )
        return torch.float8_e4m3fn
    if name != "auto":
        return to_torch_dtype(name)
    if device.type == "cpu" and cfg.model_config.dtype is None:
        return torch.bfloat16
    return model_dtype

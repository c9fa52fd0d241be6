"""CacheConfig: the paged KV cache (block size, how many blocks, prefix caching) and its dtype."""

from __future__ import annotations

from dataclasses import dataclass

from novainfer.config.fields import setting

CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's names of an e4m3 cache with per-layer k/v scales
STATE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, how many blocks, prefix caching."""

    block_size: int = setting(16, "tokens per KV-cache block (a power of two)")
    num_gpu_blocks: int | None = setting(
        None,
        "KV-cache blocks to allocate instead of sizing from free memory "
        "(GPU) or --cpu-kv-cache-tokens (CPU); testing preemption",
        flag="num-gpu-blocks-override",
        shown="sized from memory",
    )
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory the engine may use")
    cpu_kv_cache_tokens: int = setting(
        32768, "KV cache capacity on the CPU, in tokens (32k bf16 tokens of the default model are 0.75 GB)"
    )
    cache_dtype: str = setting(
        "auto",
        "auto: the model's dtype; bfloat16 on the CPU unless --dtype float32; fp8 (fp8_e4m3): float8 e4m3 with a "
        "k and v scale per layer (1.0 unless the checkpoint has them), half bf16's bytes, GPU (Triton) only",
        flag="kv-cache-dtype",
        choices=CACHE_DTYPES,
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of a prompt prefix seen before")
    mamba_ssm_cache_dtype: str = setting(
        "float32",
        "the recurrent state of linear-attention layers (Gated DeltaNet): float32 as transformers keeps it; "
        "bfloat16 halves its bytes and the decode kernel's traffic (the update still runs in float32)",
        choices=STATE_DTYPES,
    )

    def validate(self) -> None:
        """Reject values that can never work, naming the field."""
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(CACHE_DTYPES)}; got {self.cache_dtype!r}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype must be one of {', '.join(STATE_DTYPES)}; got {self.mamba_ssm_cache_dtype!r}"
            )
        if self.cpu_kv_cache_tokens < 1:
            raise ValueError(f"cpu_kv_cache_tokens must be >= 1, got {self.cpu_kv_cache_tokens}")

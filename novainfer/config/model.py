"""ModelConfig: where the model lives and how its tensors are laid out; dtype names checked without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from novainfer.config.fields import derived, setting

if TYPE_CHECKING:  # torch is imported where tensors are made (the engine core), never by the server's front-end
    import torch

_DTYPE_NAMES = {
    "auto": None,
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
QUANTIZATIONS = ("gguf", "fp8", "none")


@dataclass(frozen=True)
class ModelConfig:
    """Where the model lives and how its tensors are laid out."""

    model: str | None = setting(
        None, "HF folder or .gguf file (default: SmolLM2-135M-Instruct, shipped with the install)", cli=False
    )
    hf_config: Any = derived(None, "transformers.PretrainedConfig, filled by the loader")
    dtype: torch.dtype | str | None = setting(
        None,
        "auto: bfloat16 on GPU; on the CPU bfloat16 with AVX512-BF16/AMX, else float32",
        choices=("auto", "float32", "float16", "bfloat16"),
    )
    quantization: str | None = setting(
        None,
        "gguf: keep a GGUF file's blocks quantized on the CPU; none: dequantize them; "
        "fp8: a bf16/fp16 checkpoint's linear weights to float8 at load (CUDA sm_89+, or the CPU)",
        choices=QUANTIZATIONS,
        shown="gguf for a GGUF file on the CPU unless --dtype float32",
    )
    max_model_len: int | None = setting(
        None, "longest prompt + output, at most what the KV cache holds", shown="the model's max_position_embeddings"
    )
    tokenizer: str | None = setting(None, "tokenizer folder", shown="the model's")
    seed: int = setting(0, "random seed of the engine", cli=False)  # the CLI's --seed is a sampling seed
    load_format: str = setting(
        "auto",
        "auto: the weights in the folder or GGUF file; dummy: a config-only "
        "folder, weights drawn at random in place (benchmarks)",
        choices=("auto", "dummy"),
    )

    @property
    def is_gguf(self) -> bool:
        return self.model is not None and self.model.endswith(".gguf")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """dtype as a torch.dtype: from_kwargs keeps dtype as a checked name ("float32"), so that building a
        config never imports torch (the server's front-end); read dtype through this (None: the default)."""
        return to_torch_dtype(self.dtype)


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

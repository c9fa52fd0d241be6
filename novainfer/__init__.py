"""NovaInfer: a readable, fast LLM inference engine on PyTorch and Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from novainfer.outputs import CompletionOutput, RequestOutput
from novainfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from novainfer.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """LLM is imported on first use: it brings torch, which `import novainfer` (the server's front-end) must not."""
    if name == "LLM":
        from novainfer.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'novainfer' has no attribute {name!r}")

"""NovaInfer: a readable, fast LLM inference engine on PyTorch and Triton."""
from novainfer.entrypoints.llm import LLM
from novainfer.outputs import CompletionOutput, RequestOutput
from novainfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

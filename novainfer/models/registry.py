"""Maps config.architectures to model classes: a new model registers here and nowhere else."""
from __future__ import annotations

from typing import Any

from torch import nn

from novainfer.models.llama import LlamaForCausalLM
from novainfer.models.qwen2 import Qwen2ForCausalLM
from novainfer.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {archs or '(none given)'}; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}")

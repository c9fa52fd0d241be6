"""Maps config.architectures to model classes: a new model registers here and nowhere else."""

from __future__ import annotations

from typing import Any

from torch import nn

from novainfer.models.gemma2 import Gemma2ForCausalLM
from novainfer.models.gemma3 import Gemma3ForCausalLM
from novainfer.models.gemma4 import Gemma4ForCausalLM
from novainfer.models.gpt_oss import GptOssForCausalLM
from novainfer.models.llama import LlamaForCausalLM
from novainfer.models.mistral import MistralForCausalLM
from novainfer.models.mixtral import MixtralForCausalLM
from novainfer.models.phi3 import Phi3ForCausalLM
from novainfer.models.qwen2 import Qwen2ForCausalLM
from novainfer.models.qwen2_moe import Qwen2MoeForCausalLM
from novainfer.models.qwen3 import Qwen3ForCausalLM
from novainfer.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)
from novainfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # its language model (loader/model_info.py)
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none given)'}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )

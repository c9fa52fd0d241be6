"""Tiny random hybrid checkpoints (Qwen3.5 dense and MoE, Qwen3-Next: Gated DeltaNet + gated attention) and the
prompts run on them, for tests/test_qwen3_5.py and tests/gpu/qwen35_checks.py (no pytest here: the GPU machine may
lack it)."""

from __future__ import annotations

import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.tiny_models import make_tokenizer

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "def add(a, b):",
]
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONFIGS = {  # layer 3 is full attention, 0-2 linear (the 3:1 plan); two key heads serve four value heads
    "qwen3_5": ("Qwen3_5TextConfig", dict(intermediate_size=96)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE),  # no intermediate_size: every layer is sparse
    "qwen3_next": ("Qwen3NextConfig", dict(MOE, intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1])),
}


def text_config(arch: str, vocab: int, eos: int, pad: int) -> transformers.PretrainedConfig:
    cls, extra = CONFIGS[arch]
    return getattr(transformers, cls)(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        initializer_range=0.1,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        **extra,
    )


def randomize(model: torch.nn.Module) -> None:
    """Norm offsets, decays and routers away from their initial values, so (1 + w), A_log, dt_bias and uneven
    routing all bite."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(3.0)


def build(path: str, arch: str, conditional: bool = False) -> str:
    tokenizer = make_tokenizer(400)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    text = text_config(arch, len(tokenizer), eos, pad)
    torch.manual_seed(3)
    if conditional:
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            num_position_embeddings=16,
        )
        config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True)
        model = transformers.Qwen3_5ForConditionalGeneration(config).float()
    else:
        model = AutoModelForCausalLM.from_config(text, dtype=torch.float32)
    randomize(model)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    # the multi-token-prediction head real checkpoints ship: never used, skipped on load
    save_file(
        {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)},
        os.path.join(path, "mtp.safetensors"),
    )
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=[eos, pad]).save_pretrained(path)
    return path

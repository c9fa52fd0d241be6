"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norms, no bias) and Qwen2-MoE's layer
plan, without the shared expert."""

from novainfer.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qkv_bias = False
    qk_norm = True
    shared_expert = False

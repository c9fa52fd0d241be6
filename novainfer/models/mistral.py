"""Mistral: the Llama decoder with a sliding window on every layer (config.sliding_window; None = full)."""

from novainfer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Nothing to override: LlamaAttention reads the window from the config."""

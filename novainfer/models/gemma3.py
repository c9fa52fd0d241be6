"""Gemma 3 (text): Gemma 2's layer plus per-head q/k norms; sliding and global layers each take their own
rotary base from the config's per-layer-type rope parameters (read by LlamaAttention's get_rope)."""

from novainfer.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

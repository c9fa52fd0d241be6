"""Model building blocks (linear, attention, norms, rotary, MoE, sampler) and the quantization methods they call."""

"""Lab: what 8 bits in another format would give where e4m3 gives 94%: fake-quantized K/V (a float32 cache holding
rounded values) as int8 with one scale per (token, head) (absmax / 127) and as llama.cpp's q8_0 cache type (one
scale per 32 values), beside e4m3 (scale 1.0) and bfloat16 rounding. Same windows and measure as kv_sink.py."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kv_sink  # noqa: E402  (its store_kv patch applies mode["p"] = 0 through its fake quantizer)
from kv_smooth import compare  # noqa: E402

from novainfer import LLM  # noqa: E402
from novainfer.kernels.kv_fp8 import to_fp8  # noqa: E402
from novainfer.loader.default_model import default_model_path  # noqa: E402


def int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, H, D] rounded to int8 with one absmax / 127 scale per `block` values along D, read back as float."""
    t, h, d = x.shape
    xb = x.float().reshape(t, h, d // block, block)
    s = xb.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
    return ((xb / s).round().clamp(-127, 127) * s).reshape(t, h, d).to(x.dtype)


QUANT = {
    "e4m3 (scale 1.0)": lambda x: to_fp8(x, 1.0).to(x.dtype),
    "bfloat16": lambda x: x.to(torch.bfloat16).to(x.dtype),
    "int8, a scale per (token, head)": lambda x: int8_blocks(x, x.shape[-1]),
    "int8, a scale per 32 (q8_0)": lambda x: int8_blocks(x, 32),
}


def main():
    model = default_model_path()
    probe = LLM(model, device="cpu", dtype="float32", attention_backend="torch")
    seqs = kv_sink.text_windows(probe.get_tokenizer(), int(os.environ.get("WINDOWS", 8)), 256)
    probe.llm_engine.shutdown()
    ref = kv_sink.run(model, seqs, None)
    print("| K and V rounded as | top-1 vs float32 KV | KL |")
    for name, fn in QUANT.items():
        kv_sink.to_fp8 = lambda x, scale, fn=fn: fn(x)  # the patch's quantizer (scale is 1.0 there)
        a, kl = compare(ref, kv_sink.run(model, seqs, 0))
        print(f"| {name} | {a:.2%} | {kl:.5f} |", flush=True)


if __name__ == "__main__":
    main()

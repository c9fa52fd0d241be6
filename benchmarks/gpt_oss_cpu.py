"""A gpt-oss-20b-shape GGUF with MXFP4 experts (random weights) run by NovaInfer and llama.cpp on the CPU, same run.

The file is written directly with gguf-py in the layout llama.cpp's converter gives a released gpt-oss-20b
(general.file_type MOSTLY_MXFP4_MOE): ffn_gate_exps / ffn_up_exps / ffn_down_exps in MXFP4 (random e2m1 codes, every
block's scale 2^-7, so a weight's std is about 1/sqrt(2880)), their biases, the router, sinks and norms in F32, the
attention, embedding and output matrices in F16 (random normal), gpt-oss-20b's metadata (YaRN, sliding window 128,
32 experts, top 4) and the default model's tokenizer padded to 201,088 tokens. About 13.8 GB, written once under
--path and reused (tensors streamed: the writer holds one at a time).

NovaInfer keeps the experts in four bits (4.5 bits a weight in the C kernels' panels) and the rest in its default
CPU dtype, so the model takes about 14.5 GB plus its KV cache: run it only when `free -g` shows that much available.
The timing is benchmarks/qwen35_cpu.py's (each engine in its own process, the same thread count, batch-1 greedy
decode tok/s and a prefill on fresh prompts):
    python benchmarks/gpt_oss_cpu.py --threads 2 --new-tokens 9 --prefill-len 128 --repeat 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_PATH = "/tmp/novainfer-bench/gpt-oss-20b-random-mxfp4.gguf"
ARCH = "gpt-oss"
# gpt-oss-20b's config.json in the GGUF's terms
SHAPE = dict(layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, inter=2880, vocab=201088)
MXFP4_SCALE = 127 - 7  # e8m0 byte of every block: 2^-7


def metadata(w, s: dict) -> None:
    """The gpt-oss.* keys llama.cpp's converter writes for gpt-oss-20b."""
    a = ARCH
    for key, value in {
        "block_count": s["layers"],
        "context_length": 131072,
        "embedding_length": s["hidden"],
        "feed_forward_length": s["inter"],
        "attention.head_count": s["heads"],
        "attention.head_count_kv": s["kv_heads"],
        "attention.key_length": s["head_dim"],
        "attention.value_length": s["head_dim"],
        "attention.sliding_window": 128,
        "expert_count": s["experts"],
        "expert_used_count": s["top_k"],
        "expert_feed_forward_length": s["inter"],
        "rope.scaling.original_context_length": 4096,
    }.items():
        w.add_uint32(f"{a}.{key}", value)
    for key, value in {
        "rope.freq_base": 150000.0,
        "rope.scaling.factor": 32.0,
        "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }.items():
        w.add_float32(f"{a}.{key}", value)
    w.add_string(f"{a}.rope.scaling.type", "yarn")


def tensor_plan(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [.., out, in], kind: f32 / f16 / mxfp4) in the converter's order."""
    h, q, kv, e, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["experts"], s["inter"]
    plan = [("token_embd.weight", (s["vocab"], h), "f16")]
    for layer in range(s["layers"]):
        p = f"blk.{layer}."
        plan += [
            (p + "attn_norm.weight", (h,), "norm"),
            (p + "attn_q.weight", (q, h), "f16"),
            (p + "attn_q.bias", (q,), "f32"),
            (p + "attn_k.weight", (kv, h), "f16"),
            (p + "attn_k.bias", (kv,), "f32"),
            (p + "attn_v.weight", (kv, h), "f16"),
            (p + "attn_v.bias", (kv,), "f32"),
            (p + "attn_output.weight", (h, q), "f16"),
            (p + "attn_output.bias", (h,), "f32"),
            (p + "attn_sinks.weight", (s["heads"],), "f32"),
            (p + "post_attention_norm.weight", (h,), "norm"),
            (p + "ffn_gate_inp.weight", (e, h), "f32"),
            (p + "ffn_gate_inp.bias", (e,), "f32"),
            (p + "ffn_down_exps.weight", (e, h, i), "mxfp4"),
            (p + "ffn_gate_exps.weight", (e, i, h), "mxfp4"),
            (p + "ffn_up_exps.weight", (e, i, h), "mxfp4"),
            (p + "ffn_down_exps.bias", (e, h), "f32"),
            (p + "ffn_gate_exps.bias", (e, i), "f32"),
            (p + "ffn_up_exps.bias", (e, i), "f32"),
        ]
    return plan + [("output_norm.weight", (h,), "norm"), ("output.weight", (s["vocab"], h), "f16")]


def tensor_data(rng: np.random.Generator, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Random values: MXFP4 blocks (scale byte, then 16 bytes of codes), normal matrices of std 1/sqrt(in)
    (the embedding 0.02, the output 4/sqrt(in): clear greedy choices), small biases, norms near one."""
    if kind == "mxfp4":
        *lead, k = shape
        blocks = np.empty((*lead, k // 32, 17), np.uint8)
        blocks[..., 0] = MXFP4_SCALE
        blocks[..., 1:] = np.frombuffer(rng.bytes(blocks[..., 1:].size), np.uint8).reshape(*lead, k // 32, 16)
        return blocks.reshape(*lead, -1)
    if kind == "norm":
        return rng.uniform(0.8, 1.2, shape).astype(np.float32)
    if kind == "f32":
        return (rng.standard_normal(shape, dtype=np.float32) * (0.02 if len(shape) > 1 else 0.1)).astype(np.float32)
    std = 0.02 if name == "token_embd.weight" else (4.0 if name == "output.weight" else 1.0) / np.sqrt(shape[-1])
    out = np.empty(shape, np.float16)
    for r in range(0, shape[0], 8192):  # in row chunks: the embedding's float32 draw alone would be 2.3 GB
        out[r : r + 8192] = rng.standard_normal((min(8192, shape[0] - r), shape[1]), dtype=np.float32) * std
    return out


def make_file(path: str, s: dict = SHAPE, seed: int = 0) -> str:
    """Write the file (to a temporary name, renamed when complete) and return its path."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    from benchmarks.gguf_checkpoint import add_tokenizer, finish_file
    from novainfer.loader.default_model import default_model_path

    rng = np.random.default_rng(seed)
    plan = tensor_plan(s)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".part"
    w = GGUFWriter(tmp, ARCH)
    w.add_name("random gpt-oss-20b-shape MXFP4 (NovaInfer benchmark)")
    w.add_file_type(38)  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    metadata(w, s)
    add_tokenizer(w, default_model_path(), s["vocab"])
    for name, shape, kind in plan:
        if kind == "mxfp4":
            row = shape[-1] // 32 * 17
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8), int(np.prod(shape[:-1])) * row, T.MXFP4)
        else:
            dtype = np.dtype(np.float16 if kind == "f16" else np.float32)
            w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    return finish_file(w, (tensor_data(rng, name, shape, kind) for name, shape, kind in plan), tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=DEFAULT_PATH)
    args, rest = ap.parse_known_args()
    if not os.path.exists(args.path):
        t = time.perf_counter()
        make_file(args.path)
        print(f"wrote {args.path} ({os.path.getsize(args.path) / 1e9:.1f} GB) in {time.perf_counter() - t:.0f} s")
    from benchmarks import qwen35_cpu

    sys.argv = [qwen35_cpu.__file__, "--path", args.path, "--label", "gpt-oss-20b shape, MXFP4 experts", *rest]
    qwen35_cpu.main()


if __name__ == "__main__":
    main()

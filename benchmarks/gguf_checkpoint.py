"""Random-weight GGUF files in llama.cpp's Q4_K_M tensor-type mix, with real model shapes (no model hub here).

The tensor types follow llama.cpp's Q4_K_M recipe (llama_tensor_get_type): Q4_K for the matrices and the
token embedding, Q6_K for output.weight and for attn_v / ffn_down of the layers use_more_bits picks (14 of
Qwen2.5-7B's 28), F32 norms and biases. The quants are random bytes; the float16 super-block scales are set
so each matrix's weights have a standard deviation of about gain / sqrt(input size), which keeps activations
of order one through the layers. Tensors are streamed: the writer holds one tensor at a time, never the file.

The tokenizer is the default model's (SmolLM2, byte-level BPE, 49,152 tokens) padded with "[PAD<i>]" tokens
of type UNUSED to the vocabulary size, as llama.cpp's converter pads Qwen's vocabulary (a smaller vocabulary
keeps its first tokens and their merges); llama.cpp and transformers (hence NovaInfer) both load it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, TokenType

# elements and bytes per block, the offsets of the float16 scales, and the weight std per unit of d
# (random 6-bit scales/mins with dmin = 7.5 d for Q4_K; random int8 scales and 6-bit quants for Q6_K)
BLOCKS = {T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
STD_PER_D = {T.Q4_K: 258.0, T.Q6_K: 1366.0}


@dataclass(frozen=True)
class Qwen2Shape:
    """The qwen2 hyper-parameters a GGUF records."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int = 32768
    rope_theta: float = 1e6
    rms_eps: float = 1e-6


SHAPES = {
    "qwen2.5-7b": Qwen2Shape(layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064),
    # multiples of 256 where the K-quants need them; two layers, so one of each attn_v / ffn_down type
    "tiny": Qwen2Shape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=2048, context=2048),
}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in a Q4_K_M file."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_plan(s: Qwen2Shape) -> list[tuple[str, tuple[int, ...], T]]:
    """(GGUF name, shape [out, in] or [n], type) in llama.cpp's file order."""
    h, kv = s.hidden, s.kv_heads * (s.hidden // s.heads)
    plan = [("token_embd.weight", (s.vocab, h), T.Q4_K)]
    for i in range(s.layers):
        more = T.Q6_K if use_more_bits(i, s.layers) else T.Q4_K
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (h,), T.F32), (p + "attn_q.weight", (h, h), T.Q4_K),
                 (p + "attn_q.bias", (h,), T.F32), (p + "attn_k.weight", (kv, h), T.Q4_K),
                 (p + "attn_k.bias", (kv,), T.F32), (p + "attn_v.weight", (kv, h), more),
                 (p + "attn_v.bias", (kv,), T.F32), (p + "attn_output.weight", (h, h), T.Q4_K),
                 (p + "ffn_norm.weight", (h,), T.F32), (p + "ffn_gate.weight", (s.intermediate, h), T.Q4_K),
                 (p + "ffn_up.weight", (s.intermediate, h), T.Q4_K),
                 (p + "ffn_down.weight", (h, s.intermediate), more)]
    plan += [("output_norm.weight", (h,), T.F32), ("output.weight", (s.vocab, h), T.Q6_K)]
    return plan


def random_blocks(rng: np.random.Generator, qtype: T, n: int, k: int, std: float) -> np.ndarray:
    """uint8 [n, bytes per row] of random quants whose float16 scales give weights of about this std."""
    per, nbytes = BLOCKS[qtype]
    b = np.frombuffer(rng.bytes(n * (k // per) * nbytes), np.uint8).reshape(n, k // per, nbytes).copy()
    d = (std / STD_PER_D[qtype] * rng.uniform(0.75, 1.25, (n, k // per, 1))).astype(np.float16)
    if qtype == T.Q4_K:
        b[..., 0:2] = d.view(np.uint8)
        b[..., 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8)  # dmin: mean about zero
    else:
        b[..., 208:210] = d.view(np.uint8)
    return b.reshape(n, -1)


def tensor_data(rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: T) -> np.ndarray:
    if qtype == T.F32:
        if name.endswith("norm.weight"):
            return rng.uniform(0.8, 1.2, shape).astype(np.float32)
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)  # q/k/v biases
    gain = 4.0 if name == "output.weight" else 1.0  # logits of std ~4: clear greedy choices
    return random_blocks(rng, qtype, shape[0], shape[1], gain / np.sqrt(shape[1]))


def add_tokenizer(w: GGUFWriter, source: str, vocab: int) -> None:
    """The source GGUF's tokenizer, padded with UNUSED tokens to `vocab` entries."""
    r = GGUFReader(source)
    f = lambda key: r.fields[key].contents()  # noqa: E731
    tokens, types = list(f("tokenizer.ggml.tokens"))[:vocab], list(f("tokenizer.ggml.token_type"))[:vocab]
    kept = set(tokens)  # a smaller vocabulary keeps the merges that make a kept token (the tests' tiny file)
    merges = [m for m in f("tokenizer.ggml.merges") if m.replace(" ", "") in kept]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [int(TokenType.UNUSED)] * (vocab - len(types))
    w.add_tokenizer_model(f("tokenizer.ggml.model"))
    w.add_tokenizer_pre(f("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(f("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(f("tokenizer.ggml.eos_token_id"))
    w.add_pad_token_id(f("tokenizer.ggml.padding_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(f("tokenizer.chat_template"))


def write_qwen2_q4_k_m(path: str, shape: Qwen2Shape, seed: int = 0) -> str:
    """Write the file (to a temporary name, renamed when complete) and return its path."""
    from novainfer.loader.default_model import default_model_path
    rng = np.random.default_rng(seed)
    plan = tensor_plan(shape)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".part"
    w = GGUFWriter(tmp, "qwen2")
    w.add_name("random Qwen2.5-7B-shape Q4_K_M (NovaInfer benchmark)")
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    add_tokenizer(w, default_model_path(), shape.vocab)
    for name, dims, qtype in plan:
        if qtype == T.F32:
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            per, nbytes = BLOCKS[qtype]
            row = dims[1] // per * nbytes
            w.add_tensor_info(name, (dims[0], row), np.dtype(np.uint8), dims[0] * row, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, qtype in plan:
        w.write_tensor_data(tensor_data(rng, name, dims, qtype))
    w.close()
    os.replace(tmp, path)
    return path

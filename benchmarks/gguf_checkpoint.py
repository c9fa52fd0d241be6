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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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
    "qwen2.5-32b": Qwen2Shape(layers=64, hidden=5120, heads=40, kv_heads=8, intermediate=27648, vocab=152064),
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
        plan += [
            (p + "attn_norm.weight", (h,), T.F32),
            (p + "attn_q.weight", (h, h), T.Q4_K),
            (p + "attn_q.bias", (h,), T.F32),
            (p + "attn_k.weight", (kv, h), T.Q4_K),
            (p + "attn_k.bias", (kv,), T.F32),
            (p + "attn_v.weight", (kv, h), more),
            (p + "attn_v.bias", (kv,), T.F32),
            (p + "attn_output.weight", (h, h), T.Q4_K),
            (p + "ffn_norm.weight", (h,), T.F32),
            (p + "ffn_gate.weight", (s.intermediate, h), T.Q4_K),
            (p + "ffn_up.weight", (s.intermediate, h), T.Q4_K),
            (p + "ffn_down.weight", (h, s.intermediate), more),
        ]
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


def add_byte_tokenizer(w: GGUFWriter, vocab: int) -> None:
    """A byte-level BPE tokenizer of GPT-2's 256 byte symbols, one merge (transformers' converter needs merges or
    scores) and an end-of-text token, padded with UNUSED tokens to `vocab` entries: for a machine without the
    default model's package (the GPU benchmarks)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["<|endoftext|>", "\u0120t"]
    types = [int(TokenType.NORMAL)] * 256 + [int(TokenType.CONTROL), int(TokenType.NORMAL)]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [int(TokenType.UNUSED)] * (vocab - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    w.add_add_bos_token(False)


def write_qwen2_q4_k_m(path: str, shape: Qwen2Shape, seed: int = 0, byte_tokenizer: bool = False) -> str:
    """Write the file (to a temporary name, renamed when complete) and return its path; byte_tokenizer: the
    tokenizer of add_byte_tokenizer instead of the default model's."""
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
    if byte_tokenizer:
        add_byte_tokenizer(w, shape.vocab)
    else:
        from novainfer.loader.default_model import default_model_path

        add_tokenizer(w, default_model_path(), shape.vocab)
    for name, dims, qtype in plan:
        if qtype == T.F32:
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            per, nbytes = BLOCKS[qtype]
            row = dims[1] // per * nbytes
            w.add_tensor_info(name, (dims[0], row), np.dtype(np.uint8), dims[0] * row, raw_dtype=qtype)
    return finish_file(w, (tensor_data(rng, name, dims, qtype) for name, dims, qtype in plan), tmp, path)


def finish_file(w: GGUFWriter, tensors: Iterable[np.ndarray], tmp: str, path: str) -> str:
    """The header, metadata and tensor infos added to w, then each tensor's data as it is drawn (one in memory at
    a time); the file renamed from tmp to path once complete."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in tensors:
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, path)
    return path


# ---- GGUF files made by llama.cpp's own converter and quantizer ----------------------------------------------
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp holds convert_hf_to_gguf.py, conversion/, gguf-py/
# the converter names a BPE pre-tokenizer by the hash of a test string's tokens; a tiny test tokenizer hashes to
# none it knows, so the runner pins this one (GPT-2's split regex: the tiny tokenizers' ByteLevel pre-tokenizer);
# the families whose converter reads only a SentencePiece tokenizer.model (Gemma, Mistral, Phi-3) or Gemma 4's
# byte-fallback BPE write the tiny
# checkpoints' byte-level BPE tokenizer.json as llama.cpp's converter writes any BPE one (tokenizer model gpt2)
TEST_PRE_TOKENIZER = "gpt-2"
LLAMA_FTYPES = {"Q8_0": 7, "Q4_K_M": 15, "Q4_0": 2, "Q6_K": 18}  # llama_ftype values for llama_model_quantize
_CONVERT_RUNNER = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sentencepiece = conversion.base.TextModel._set_vocab_sentencepiece
def byte_level_without_model(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        return self._set_vocab_gpt2()
    return sentencepiece(self, *args, **kwargs)
conversion.base.TextModel._set_vocab_sentencepiece = byte_level_without_model
import conversion.gemma
gemma4_vocab = conversion.gemma.Gemma4Model.set_vocab
def gemma4_vocab_or_byte_level(self):
    try:
        gemma4_vocab(self)
    except FileNotFoundError:  # not Gemma 4's byte-fallback BPE: the tiny checkpoints' byte-level one
        self._set_vocab_gpt2()
conversion.gemma.Gemma4Model.set_vocab = gemma4_vocab_or_byte_level
import conversion.phi
phi3_vocab = conversion.phi.Phi3MiniModel.set_vocab
conversion.phi.Phi3MiniModel.set_vocab = lambda self: (
    phi3_vocab(self) if (self.dir_model / "tokenizer.model").is_file() else self._set_vocab_gpt2()
)
import json
for args in json.loads(sys.argv[3]):  # one run per output file, the imports paid once
    sys.argv = [src + "/convert_hf_to_gguf.py"] + args
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
"""


def llama_cpp_converter(download: bool = True) -> str | None:
    """The vendor/llama.cpp folder of llama-cpp-python's sdist: $NOVAINFER_LLAMA_CPP_SRC, else a copy under
    CACHE_DIR, fetched once with `pip download` (76 MB, the converter sources kept); None if unobtainable."""
    import shutil
    import subprocess
    import sys
    import tarfile
    import tempfile

    from novainfer.platform import CACHE_DIR

    env = os.environ.get("NOVAINFER_LLAMA_CPP_SRC")
    if env:
        return env if os.path.isfile(os.path.join(env, "convert_hf_to_gguf.py")) else None
    dest = os.path.join(CACHE_DIR, f"llama.cpp-{LLAMA_CPP_PYTHON}")
    if os.path.isfile(os.path.join(dest, "convert_hf_to_gguf.py")):
        return dest
    if not download:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            tmp,
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
        ]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        sdist = os.path.join(tmp, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
        inner = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(inner) and m.name[len(inner) :].startswith(keep) and (m.isfile() or m.isdir())
            ]
            tar.extractall(tmp, members=members, filter="data")
        part = dest + ".part"
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(os.path.join(tmp, inner), part)
        os.replace(part, dest)
    return dest


def convert_hf_to_gguf(
    hf_dir: str, out: str, outtype: str = "f32", pre_tokenizer: str = TEST_PRE_TOKENIZER, no_mtp: bool = True
) -> str:
    """Run llama.cpp's convert_hf_to_gguf.py (its own gguf-py) on an HF folder: outtype f32, f16, bf16 or q8_0.
    no_mtp: pass --no-mtp (the converter refuses it for architectures without a multi-token-prediction head)."""
    return convert_hf_to_ggufs(hf_dir, {outtype: out}, pre_tokenizer, no_mtp)[outtype]


def convert_hf_to_ggufs(
    hf_dir: str, outs: dict[str, str], pre_tokenizer: str = TEST_PRE_TOKENIZER, no_mtp: bool = True
) -> dict[str, str]:
    """convert_hf_to_gguf for several outtypes ({outtype: path}) of one folder in one converter process (its
    torch and transformers imports, most of a tiny model's conversion time, paid once)."""
    import json
    import subprocess
    import sys

    src = llama_cpp_converter()
    if src is None:
        raise RuntimeError(f"llama.cpp's converter (llama-cpp-python=={LLAMA_CPP_PYTHON} sdist) is unavailable")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NO_LOCAL_GGUF"] = "1"  # the runner puts the sdist's gguf-py first itself
    # --no-mtp: the random checkpoints have no multi-token-prediction head (NovaInfer never uses one)
    runs = [
        [hf_dir, "--outfile", out, "--outtype", outtype, *(["--no-mtp"] if no_mtp else [])]
        for outtype, out in outs.items()
    ]
    cmd = [sys.executable, "-c", _CONVERT_RUNNER, src, pre_tokenizer, json.dumps(runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not all(os.path.isfile(out) for out in outs.values()):
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{proc.stderr[-3000:]}")
    return dict(outs)


def convert_side_by_side(jobs: list[tuple[str, dict[str, str]]], no_mtp: bool = True) -> list[dict[str, str]]:
    """convert_hf_to_ggufs for each (hf_dir, {outtype: path}), the converter processes running side by side."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: convert_hf_to_ggufs(job[0], job[1], no_mtp=no_mtp), jobs))


def llama_quantize(src: str, out: str, ftype: str = "Q4_K_M", threads: int = 2) -> str:
    """llama.cpp's quantizer (llama_model_quantize through llama_cpp's binding) from a float GGUF."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    return out


@dataclass(frozen=True)
class Qwen35Shape:
    """The Qwen3.5 text-model hyper-parameters of a random checkpoint (every 4th layer full attention)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    vocab: int
    tie: bool = True
    experts: int = 0  # > 0: Qwen3.5-MoE (every layer sparse, with a shared expert)


QWEN35_SHAPES = {
    # Qwen3.5-0.8B's text model (the vision tower left out): 6 of 24 layers full attention
    "qwen3.5-0.8b": Qwen35Shape(
        layers=24,
        hidden=1024,
        heads=8,
        kv_heads=2,
        head_dim=256,
        intermediate=3584,
        linear_k_heads=16,
        linear_v_heads=16,
        linear_k_dim=128,
        linear_v_dim=128,
        vocab=248320,
    ),
    # rows of 256 where the K-quants need them; two key heads serve four value heads (the converter reorders them);
    # llama.cpp takes the value head size to equal the key head size (ssm.state_size)
    "tiny": Qwen35Shape(
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=512,
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_dim=64,
        linear_v_dim=64,
        vocab=512,
        tie=False,
    ),
    "tiny-moe": Qwen35Shape(
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=256,
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_dim=64,
        linear_v_dim=64,
        vocab=512,
        tie=False,
        experts=4,
    ),
}


def write_qwen35_hf(path: str, shape: Qwen35Shape, seed: int = 0, dtype: str = "float32") -> str:
    """A random Qwen3.5 (or -MoE) ForCausalLM checkpoint with the tests' byte-level BPE tokenizer (the config's
    vocab_size pads it), its norm offsets, decays and routers moved off their initial values so every converter
    transform bites."""
    import torch
    import transformers

    from tests.tiny_hybrid import randomize
    from tests.tiny_models import make_tokenizer

    tokenizer = make_tokenizer(400)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=shape.linear_k_dim,
        linear_value_head_dim=shape.linear_v_dim,
        linear_num_key_heads=shape.linear_k_heads,
        linear_num_value_heads=shape.linear_v_heads,
        initializer_range=0.05,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        tie_word_embeddings=shape.tie,
    )
    if shape.experts:
        config = transformers.Qwen3_5MoeTextConfig(
            num_experts=shape.experts,
            num_experts_per_tok=2,
            moe_intermediate_size=shape.intermediate,
            shared_expert_intermediate_size=shape.intermediate,
            **common,
        )
    else:
        config = transformers.Qwen3_5TextConfig(intermediate_size=shape.intermediate, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    randomize(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # logits of std ~3: clear greedy choices
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=[eos, pad]).save_pretrained(path)
    return path


def gemma4_e2b_config() -> Any:
    """Gemma-4-E2B's text config: benchmarks/kv_capacity.py's attention layout at the published hidden (1536), MLP
    (6144, double-wide on the 20 KV-shared layers), vocabulary (262,144), per-layer input (256 per layer over the
    whole vocabulary) and logit soft-cap (30) sizes, embeddings tied."""
    import transformers

    from benchmarks.kv_capacity import gemma4_e2b

    full = dict(
        hidden_size=1536,
        intermediate_size=6144,
        vocab_size=262144,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    )
    return transformers.Gemma4TextConfig(**{**gemma4_e2b().to_dict(), **full})


GEMMA4_CONFIGS = {"gemma-4-e2b": gemma4_e2b_config}


def write_gemma4_hf(path: str, config: Any, seed: int = 0, shard_bytes: int = 2 << 30) -> str:
    """A random float16 Gemma4ForCausalLM checkpoint written tensor by tensor (the model is never built: its
    parameter names and shapes come from a meta-device copy), with the tests' byte-level BPE tokenizer; float16,
    which llama.cpp's converter writes as it is (a bfloat16 tensor passes through float32 there, twice its size).
    Matrices have std 1/sqrt(input size), the embeddings 0.02, norms and layer scalars lie near one."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    from tests.tiny_models import make_tokenizer

    tokenizer = make_tokenizer(400)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.eos_token_id, config.pad_token_id, config.bos_token_id = eos, tokenizer.pad_token_id, None
    config.architectures = ["Gemma4ForCausalLM"]
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in transformers.Gemma4ForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shard.clear()

    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.float16)
        if name.endswith("layer_scalar"):
            t.uniform_(0.5, 1.5, generator=g)
        elif len(shape) == 1:
            t.uniform_(0.8, 1.2, generator=g)
        else:
            std = 0.02 if "embed_tokens" in name else shape[1] ** -0.5
            for r in range(0, shape[0], 16384):  # in row chunks: no float32 copy of the 4.7 GB per-layer table
                t[r : r + 16384].normal_(0.0, std, generator=g)
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
    flush()
    total = sum(int(torch.tensor(s).prod()) * 2 for s in shapes.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    config.dtype = "float16"
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pad_tokenizer_json(os.path.join(path, "tokenizer.json"), config.vocab_size)
    transformers.GenerationConfig(eos_token_id=[eos]).save_pretrained(path)
    return path


def pad_tokenizer_json(path: str, vocab: int) -> None:
    """Pad a BPE tokenizer.json's vocabulary with "[PAD<i>]" tokens to `vocab` entries counting its added tokens:
    Gemma's converter cuts token_embd to the tokenizer's size (its out-of-vocabulary rows), which would leave the
    random checkpoint's LM head a few hundred rows wide."""
    import json

    with open(path) as f:
        tok = json.load(f)
    table = tok["model"]["vocab"]
    want = vocab - len(tok["added_tokens"])
    table.update({f"[PAD{i}]": i for i in range(len(table), want)})
    with open(path, "w") as f:
        json.dump(tok, f, ensure_ascii=False)

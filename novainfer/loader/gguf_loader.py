"""Reads GGUF files: the HF config from its metadata, the tokenizer through transformers, and the
tensors dequantised with the gguf package and renamed to Hugging Face parameter names."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from functools import lru_cache
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from novainfer.loader import gguf_families, gguf_gemma4, gguf_gpt_oss, gguf_qwen35
from novainfer.loader.gguf_file import GGUFFile

# GGUF architecture -> (HF architecture, transformers config class name)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen35": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),  # loader/gguf_qwen35.py
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig"),  # loader/gguf_gemma4.py
    **gguf_families.ARCHITECTURES,  # Gemma 2 / 3, Phi-3, Qwen2-MoE, Qwen3-MoE (and Mixtral: llama with experts)
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig"),  # loader/gguf_gpt_oss.py
}

# per-layer GGUF tensor name -> HF name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


logger = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFFile:
    """The parsed header (no tensor data: iter_gguf_weights maps the file while it reads); a truncated or
    corrupt file fails here with an error naming it."""
    return GGUFFile(path)


def load_gguf_config(path: str) -> Any:
    """Build the transformers config the GGUF metadata describes."""
    import transformers

    reader = _reader(path)
    arch = reader.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    family = gguf_families.handles(arch, reader.metadata)
    hf_arch, config_cls = gguf_families.architecture(arch, reader.metadata) if family else ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    num_heads = int(reader.field(f"{arch}.attention.head_count"))
    hidden = int(reader.field(f"{arch}.embedding_length"))
    kwargs = dict(
        architectures=[hf_arch],
        vocab_size=int(reader.field(f"{arch}.vocab_size", int(embed.shape[1]))),
        hidden_size=hidden,
        num_hidden_layers=int(reader.field(f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=_first(reader.field(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(reader.field(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(reader.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(reader.field(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(reader.field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=reader.field("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.field("tokenizer.ggml.eos_token_id"),
        pad_token_id=reader.field("tokenizer.ggml.padding_token_id"),
    )
    if arch in gguf_qwen35.ARCHS:
        gguf_qwen35.check_keys(reader.metadata)
        kwargs.update(gguf_qwen35.config_kwargs(reader.field))
    elif arch == gguf_gemma4.ARCH:
        gguf_gemma4.check_keys(reader.metadata)
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        kwargs.update(gguf_gemma4.config_kwargs(reader.field, shapes, lambda name: _small_tensor(path, name)))
    elif family:
        gguf_families.check_keys(reader.metadata)
        kwargs.update(gguf_families.config_kwargs(reader.field, lambda name: _small_tensor(path, name)))
    elif arch == gguf_gpt_oss.ARCH:
        gguf_gpt_oss.check_keys(reader.metadata)
        kwargs.update(gguf_gpt_oss.config_kwargs(reader.field, {t.name: t.tensor_type for t in reader.tensors}))
    else:
        kwargs["intermediate_size"] = int(reader.field(f"{arch}.feed_forward_length"))
    config = getattr(transformers, config_cls)(**kwargs)
    config.allow_global_per_layer_attribute_access = True  # as model_info does for HF configs (Gemma 4's layers)
    return config


def _first(value: Any) -> int:
    """A per-layer metadata array's first entry (the family's reader sets per-layer values), or the value."""
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def _small_tensor(path: str, name: str) -> np.ndarray | None:
    """A (small) tensor's values as float32, or None where the file has no such tensor (config read from tensors)."""
    reader = _reader(path)
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    return np.asarray(dequantize(reader.tensor_data(reader.open_map(), tensor), tensor.tensor_type), np.float32)


def load_gguf_vocab(path: str) -> dict[str, int]:
    """Token -> id as the file's tokenizer.ggml.tokens lists them (no tokenizer conversion, which is slow)."""
    return {token: i for i, token in enumerate(_reader(path).field("tokenizer.ggml.tokens", []))}


TOKENIZER_CACHE_ENTRIES = 16  # converted tokenizers kept under CACHE_DIR, the most recently used


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer and chat template stored in the GGUF, converted by transformers. The conversion takes
    seconds (9 s for the default model on the 2-core machine), so the result is saved under CACHE_DIR, keyed by
    the file (path, size, modification time) and the transformers version; later loads read it in ~0.2 s."""
    import transformers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from novainfer.platform import CACHE_DIR

    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()[:16]
    cached = os.path.join(CACHE_DIR, "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(cached)
            os.utime(cached)  # most recently used: kept longest
            return tokenizer
        except Exception as e:  # a damaged cache entry: convert again and overwrite it
            logger.warning(
                "cached tokenizer of %s at %s does not load (%s); converting the GGUF's again", path, cached, e
            )
    # a warning, so the command line (which logs warnings only) says why its first seconds are silent
    logger.warning(
        "converting the tokenizer of %s from GGUF (first load only; cached in %s)",
        os.path.basename(path),
        os.path.dirname(cached),
    )
    # AutoTokenizer first builds a config from the file, which fails on gemma4's per-layer arrays (head_count_kv)
    # and on gpt-oss's rope.scaling keys: those two take the tokenizer class their checkpoints name
    arch = _reader(path).field("general.architecture")
    classes = {gguf_gemma4.ARCH: transformers.TokenizersBackend, gguf_gpt_oss.ARCH: PreTrainedTokenizerFast}
    tokenizer = classes.get(arch, AutoTokenizer).from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="tmp-", dir=os.path.dirname(cached))
        try:
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(cached, ignore_errors=True)  # a damaged entry
            os.replace(tmp, cached)  # whole or not at all: a concurrent loader sees no entry or a complete one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # left only when another loader's entry got there first
        entries = sorted(
            (e for e in os.scandir(os.path.dirname(cached)) if not e.name.startswith("tmp-")),
            key=lambda e: e.stat().st_mtime,
            reverse=True,
        )
        for old in entries[TOKENIZER_CACHE_ENTRIES:]:  # bounded: tests convert many small temporary files
            shutil.rmtree(old.path, ignore_errors=True)
    except OSError as e:  # a read-only home, or that race: this process keeps its conversion
        logger.info("did not cache the tokenizer converted from %s (%s)", path, e)
    return tokenizer


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor; None for tensors with no HF counterpart (e.g. rope_freqs)."""
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    return None


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves each head's two rotary halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_bytes(path: str, tensor) -> np.ndarray:
    """A tensor's raw bytes in memory of our own, freed once repacked: a view of the file's memory map would
    keep the map, and the pages read through it, resident (counted in RSS) until the layer repacks."""
    buf = np.empty(tensor.nbytes, np.uint8)
    with open(path, "rb") as f:
        f.seek(tensor.offset)
        if f.readinto(memoryview(buf)) != tensor.nbytes:
            raise ValueError(f"GGUF file {path} is corrupt or truncated: tensor {tensor.name} is cut short")
    return buf


def _tensor_names(path: str):
    """The HF-name function for the file's architecture, and for qwen35 the transforms that undo its converter's
    (None for the others)."""
    reader = _reader(path)
    arch = reader.field("general.architecture")
    if arch in gguf_qwen35.ARCHS:
        fixer = gguf_qwen35.Qwen35Tensors(load_gguf_config(path))
        return fixer.hf_name, fixer
    if gguf_families.handles(arch, reader.metadata):
        fixer = gguf_families.FamilyTensors(arch, load_gguf_config(path))
        return fixer.hf_name, fixer
    if arch == gguf_gemma4.ARCH:
        fixer = gguf_gemma4.Gemma4Tensors(load_gguf_config(path))
        return fixer.hf_name, fixer
    if arch == gguf_gpt_oss.ARCH:
        fixer = gguf_gpt_oss.GptOssTensors(load_gguf_config(path))
        return fixer.hf_name, fixer
    return hf_name, None


def count_gguf_weights(path: str) -> int:
    """How many tensors iter_gguf_weights yields (for the progress bar)."""
    name_of, fixer = _tensor_names(path)
    names = [name_of(t.name) for t in _reader(path).tensors]
    return sum(1 if fixer is None else fixer.count(n) for n in names if n is not None)


def iter_gguf_weights(path: str, keep_quantized: bool = False, keep_experts: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor in HF shape) for every GGUF tensor that has an HF counterpart: float32 tensors, or
    with keep_quantized, 2-D weights of a type the CPU or GPU kernels take as GGUFQuantTensor (raw blocks, read one
    tensor at a time; the layer repacks them as soon as all its shards are in). F16 and BF16 weights count as such a
    type (the CPU multiplies them as stored); F32 ones load as tensors. keep_experts: also the [E, out, in] expert
    stacks of a type the GPU kernels take, one GGUFQuantTensor per expert, where the family's reader splits them
    (its splits_experts; layers/quantization/gguf_moe.py takes them)."""
    from novainfer.kernels.cpu.repack import SUPPORTED
    from novainfer.layers.quantization.gguf_cpu import GGUFQuantTensor
    from novainfer.layers.quantization.gguf_gpu_layout import GPU_TYPES

    kept = SUPPORTED | GPU_TYPES  # what the CPU repack or the GPU kernels take; the layer's method picks its own

    reader = _reader(path)
    arch = reader.field("general.architecture")
    num_heads = int(reader.field(f"{arch}.attention.head_count"))
    num_kv_heads = _first(reader.field(f"{arch}.attention.head_count_kv", num_heads))
    logged: set[str] = set()
    name_of, fixer = _tensor_names(path)
    file_map = reader.open_map()  # unmapped once the last tensor view is gone: no file pages stay resident
    for tensor in reader.tensors:
        name = name_of(tensor.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        qtype = GGMLQuantizationType(tensor.tensor_type)
        quantized = qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
        block = GGML_QUANT_SIZES[qtype][0]
        raw = getattr(fixer, "keep_raw", lambda _: False)(name)  # bytes the fixer turns into its own layout
        if raw:
            data = _read_bytes(path, tensor).reshape(*shape[:-1], -1)
        elif (
            keep_quantized
            and len(shape) == 2
            and qtype in kept  # quantized types, and F16 / BF16 (kept as stored)
            and (fixer is None or fixer.keep_quantized(name, shape, block))
        ) or (keep_experts and len(shape) == 3 and qtype in GPU_TYPES and getattr(fixer, "splits_experts", False)):
            data = _read_bytes(path, tensor).reshape(*shape[:-1], -1)  # one row of blocks per output row
        else:
            if keep_quantized and quantized and qtype.name not in logged:
                logged.add(qtype.name)
                logger.info(
                    "GGUF tensor type %s has no quantized kernel; its tensors (first: %s) load dequantized",
                    qtype.name,
                    tensor.name,
                )
            try:
                data = np.asarray(
                    dequantize(reader.tensor_data(file_map, tensor), tensor.tensor_type), dtype=np.float32
                ).reshape(shape)
            except Exception as exc:
                raise ValueError(
                    f"GGUF file {path}: tensor {tensor.name} of type {qtype.name} cannot be dequantized: {exc}"
                ) from None
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rotary_rows(data, num_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rotary_rows(data, num_kv_heads)
        parts = [(name, data)] if fixer is None else fixer.fix(name, data, block)
        for name, data in parts:
            if data.dtype == np.uint8 and not raw:
                shape = (data.shape[0], shape[-1])
                yield name, GGUFQuantTensor(tensor.name, np.ascontiguousarray(data), qtype, shape)
            else:
                yield name, torch.from_numpy(data.copy())  # the reader memory-maps the file read-only

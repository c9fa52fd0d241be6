"""Random-weight checkpoints with real model shapes, for benchmarks (no model hub is reachable).

`random:<name>` names a shape below (published configurations, or small ones for the CPU). The folder
holds the config and a word-level tokenizer that covers the whole vocabulary (made with `tokenizers`),
so any token id decodes. Shapes in DUMMY are written config-only and loaded with load_format="dummy"
(weights drawn in place): Qwen3-30B-A3B is ~61 GB in bf16, too much for the GPU machine's disk; the rest
are written with transformers' save_pretrained.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

CONFIGS = {
    # published shapes of Qwen2.5-0.5B and Qwen2.5-7B
    "qwen2.5-0.5b": (
        "Qwen2Config",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
    # published shapes of SmolLM2-135M (the default model) and SmolLM2-360M: a draft and a target of one vocabulary
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "smollm2-360m": (
        "LlamaConfig",
        dict(
            hidden_size=960,
            intermediate_size=2560,
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "tiny": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
    # published shapes of Qwen3-30B-A3B (128 experts, 8 active) and Gemma-2-9B
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
    "gemma-2-9b": (
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
    # published shapes of Gemma-4-31B (dense) and Gemma-4-26B-A4B (a dense MLP beside 128 experts, 8 active): 5 sliding
    # layers (window 1024, 256-wide heads) to 1 full layer (512-wide heads, fewer KV heads, K = V), 262k vocabulary
    "gemma-4-31b": (
        "Gemma4TextConfig",
        dict(
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=60,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=256,
            global_head_dim=512,
            num_global_key_value_heads=4,
            attention_k_eq_v=True,
            sliding_window=1024,
            vocab_size=262144,
            hidden_size_per_layer_input=0,
            max_position_embeddings=262144,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma-4-26b-a4b": (
        "Gemma4TextConfig",
        dict(
            hidden_size=2816,
            intermediate_size=2112,
            num_hidden_layers=30,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            global_head_dim=512,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            sliding_window=1024,
            vocab_size=262144,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
            max_position_embeddings=262144,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
    # published shapes of Qwen3.5-9B and Qwen3.5-35B-A3B (text models; hybrid: 3 Gated DeltaNet layers to 1 gated
    # full-attention layer, DeltaNet 16 key heads / 32 value heads of dim 128, conv width 4, partial RoPE 0.25)
    "qwen3.5-9b": (
        "Qwen3_5TextConfig",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            vocab_size=248320,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    "qwen3.5-35b-a3b": (
        "Qwen3_5MoeTextConfig",
        dict(
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            vocab_size=248320,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    # small shapes for the CPU: a Qwen3-MoE (16 experts, 4 active) and a dense Qwen3 with the same active
    # parameters per token (intermediate = 4 x 256), its baseline
    "qwen3-moe-small": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            vocab_size=8192,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-dense-small": (
        "Qwen3Config",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=8192,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
}
# no 15-70 GB write on the GPU machine
DUMMY = {"qwen2.5-7b", "qwen3-30b-a3b", "gemma-2-9b", "qwen3.5-9b", "qwen3.5-35b-a3b", "gemma-4-31b", "gemma-4-26b-a4b"}


def word_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def make_config(key: str) -> transformers.PretrainedConfig:
    if key not in CONFIGS:
        raise SystemExit(f"unknown random config {key!r}; choose from {sorted(CONFIGS)}")
    config_cls, kwargs = CONFIGS[key]
    return getattr(transformers, config_cls)(
        **kwargs, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0, bos_token_id=None, initializer_range=0.02
    )


def load_format(name: str) -> str:
    """The load_format a model name needs: "dummy" for the config-only shapes, else "auto"."""
    return "dummy" if name.startswith("random:") and name.split(":", 1)[1] in DUMMY else "auto"


def resolve_model(name: str, cache_dir: str = "/tmp/novainfer-bench", dtype: torch.dtype = torch.bfloat16) -> str:
    """A path as given, or `random:<config>` built once into cache_dir (on the GPU when there is one).

    Pass load_format=load_format(name) to the engine: the DUMMY shapes have no weights on disk."""
    if not name.startswith("random:"):
        return name
    key = name.split(":", 1)[1]
    config = make_config(key)
    path = os.path.join(cache_dir, key)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    # built aside and renamed into place whole: a process building the same key beside this one (two GPUs' runs)
    # never sees a half-written folder
    os.makedirs(cache_dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}-")
    if key in DUMMY:
        config.architectures = [config_architecture(config)]
        config.save_pretrained(work)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype if device == "cuda" else torch.float32)
        model.save_pretrained(work)
        del model
    word_level_tokenizer(config.vocab_size).save_pretrained(work)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        shutil.rmtree(path, ignore_errors=True)  # what an interrupted build left
    try:
        os.rename(work, path)
    except OSError:  # another process finished first
        shutil.rmtree(work, ignore_errors=True)
    return path


def config_architecture(config: transformers.PretrainedConfig) -> str:
    """The CausalLM class transformers maps this config to (what save_pretrained would record)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]

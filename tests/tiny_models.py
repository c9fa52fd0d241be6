"""Builds tiny random-weight checkpoints (HF folders) and a tokenizer made with `tokenizers`, for tests."""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
import transformers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello, my name is NovaInfer and I generate text one token at a time.",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Paged attention stores keys and values in fixed-size blocks of the cache.",
    "héllo wörld, naïve café, 你好世界, emoji 🙂🚀, numbers 0123456789.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
] * 20


def make_tokenizer(vocab_size: int = 400, extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHATML
    if extra_tokens:  # added (not special) tokens, as Qwen's <think> and <tool_call>
        fast.add_tokens(list(extra_tokens))
    return fast


WINDOW = 7  # the sliding window of the tiny windowed models: test prompts run past it
# the new families: transformers config class and what makes each one itself (tiny, so every feature bites)
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=2.0,
            sliding_window=WINDOW,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    # LongRoPE: decoding runs past original_max_position_embeddings into the long factors
    "phi3": (
        "Phi3Config",
        dict(
            original_max_position_embeddings=32,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
            sliding_window=WINDOW + 5,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=48)),
}


def make_tiny_model(
    path: str,
    arch: str = "qwen2",
    tie: bool = False,
    seed: int = 0,
    layers: int = 2,
    vocab_size: int = 400,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    extra_tokens: tuple[str, ...] = (),
    chat_template: str | None = None,
    overrides: dict | None = None,
) -> str:
    """Save a random tiny model of the given architecture (qwen2, llama, qwen3 or a FAMILIES key) plus
    tokenizer to path.

    hidden_size is num_heads * head_dim (64 by default); Qwen3 keeps its own head_dim of 32. MoE routers get
    weights three times larger than the rest, so routing is decisive and uneven rather than near-uniform.
    extra_tokens and chat_template make a tokenizer of another chat format (e.g. a thinking model's); overrides
    replace config fields of a FAMILIES entry (e.g. what a GGUF file can carry)."""
    tokenizer = make_tokenizer(vocab_size, extra_tokens)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=num_heads * head_dim,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        initializer_range=0.1,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=32)
    elif arch in FAMILIES:
        config_cls, extra = FAMILIES[arch]
        config = getattr(transformers, config_cls)(**{**common, **extra, **(overrides or {})})
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # random biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(3.0)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):
                param.normal_(0, 0.1)  # Gemma stores norms as offsets from one; zeros would hide (1 + w)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=[config.eos_token_id, tokenizer.pad_token_id]).save_pretrained(path)
    return path


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, **load_kwargs) -> list[int]:
    """Greedy continuation by Hugging Face transformers (the reference), never stopping at eos."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_kwargs).eval()
    return hf_greedy_with(model, prompt_ids, max_new_tokens)


def hf_greedy_with(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Argmax decoding with the model's own KV cache; eos is just another token here."""
    out, past, ids = [], None, torch.tensor([prompt_ids], device=model.device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]], device=model.device)
    return out


def hf_greedy_logprobs(model, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and the logprob of each, decoding token by token with the model's own cache."""
    out = []
    for ids in prompts:
        tokens, lps, past, step = [], [], None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(n):
                res = model(input_ids=step, past_key_values=past, use_cache=True)
                past, logprobs = res.past_key_values, torch.log_softmax(res.logits[0, -1].float(), -1)
                tokens.append(int(logprobs.argmax()))
                lps.append(float(logprobs[tokens[-1]]))
                step = torch.tensor([[tokens[-1]]])
        out.append((tokens, lps))
    return out

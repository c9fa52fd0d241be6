"""Builds tiny random-weight checkpoints (HF folders) and a tokenizer made with `tokenizers`, for tests."""
from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen3Config)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello, my name is NovaInfer and I generate text one token at a time.",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Paged attention stores keys and values in fixed-size blocks of the cache.",
    "héllo wörld, naïve café, 你好世界, emoji 🙂🚀, numbers 0123456789.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
] * 20


def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHATML
    return fast


def make_tiny_model(path: str, arch: str = "qwen2", tie: bool = False, seed: int = 0, layers: int = 2,
                    vocab_size: int = 400, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16) -> str:
    """Save a random tiny model of the given architecture (qwen2, llama, qwen3) plus tokenizer to path.

    hidden_size is num_heads * head_dim (64 by default); Qwen3 keeps its own head_dim of 32."""
    tokenizer = make_tokenizer(vocab_size)
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, hidden_size=num_heads * head_dim, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.1,
                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 128})
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=32)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # random biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
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

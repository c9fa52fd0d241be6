"""Random-weight checkpoints with real model shapes, for benchmarks (no model hub is reachable).

`random:qwen2.5-0.5b`, `random:qwen2.5-7b` and `random:tiny` name a Qwen2 config; the checkpoint is
written with transformers' save_pretrained next to a word-level tokenizer that covers the whole
vocabulary (made with the `tokenizers` library), so any token id decodes.
"""
from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

CONFIGS = {
    # published shapes of Qwen2.5-0.5B and Qwen2.5-7B
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False),
}


def word_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def resolve_model(name: str, cache_dir: str = "/tmp/novainfer-bench", dtype: torch.dtype = torch.bfloat16) -> str:
    """A path as given, or `random:<config>` built once into cache_dir (on the GPU when there is one)."""
    if not name.startswith("random:"):
        return name
    key = name.split(":", 1)[1]
    if key not in CONFIGS:
        raise SystemExit(f"unknown random config {key!r}; choose from {sorted(CONFIGS)}")
    path = os.path.join(cache_dir, key)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = Qwen2Config(**CONFIGS[key], rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0, bos_token_id=None,
                         initializer_range=0.02)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype if device == "cuda" else torch.float32)
    model.save_pretrained(path)
    word_level_tokenizer(config.vocab_size).save_pretrained(path)
    del model
    return path

"""KV cache capacity in tokens, before (every layer keeps the whole context) and after (the grouped layout of
worker/kv_layout.py: sliding-window layers keep their window, shared-KV layers keep nothing) at one memory budget,
for the attention shapes of Gemma-4-31B, Gemma-4-E2B, Gemma-3-27B and Mistral-7B (sliding_window=4096).

No weights: each model is built by NovaInfer's own model class from its published attention configuration (layer
count and pattern, KV heads, head dims, window, KV sharing) with the hidden, MLP and vocabulary sizes shrunk (they
do not touch the cache), and its Attention layers are sized by the functions the engine's runner calls
(kv_bytes_per_block, kv_layout_of). Prints one table:

  python benchmarks/kv_capacity.py [--budget-gib 40] [--block-size 16] [--seq-len 32768] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.checkpoints import CONFIGS  # noqa: E402
from novainfer.layers.attention import Attention  # noqa: E402
from novainfer.models.registry import get_model_class
from novainfer.worker.kv_cache import kv_bytes_per_block, kv_layout_of
from novainfer.worker.kv_layout import describe_groups

SMALL = dict(hidden_size=64, intermediate_size=64, vocab_size=256)  # sizes the cache does not depend on


def gemma4_31b() -> transformers.PretrainedConfig:
    """Gemma-4-31B: 60 layers, 5 sliding (16 KV heads x 256, window 1024) to 1 full (4 KV heads x 512, K = V); the
    published shape of benchmarks/checkpoints.py, its cache-free sizes shrunk."""
    kwargs = {**CONFIGS["gemma-4-31b"][1], **SMALL, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 256}
    return transformers.Gemma4TextConfig(**kwargs)


def gemma4_e2b() -> transformers.PretrainedConfig:
    """Gemma-4-E2B: 35 layers, 4 sliding (1 KV head x 256, window 512) to 1 full (1 KV head x 512); the last 20
    layers read earlier layers' K/V (num_kv_shared_layers)."""
    return transformers.Gemma4TextConfig(
        num_hidden_layers=35,
        layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)],
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        num_kv_shared_layers=20,
        max_position_embeddings=131072,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
        **SMALL,
    )


def gemma3_27b() -> transformers.PretrainedConfig:
    """Gemma-3-27B: 62 layers, 5 sliding (window 1024) to 1 full, 16 KV heads x 128."""
    return transformers.Gemma3TextConfig(
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        sliding_window=1024,
        max_position_embeddings=131072,
        **SMALL,
    )


def mistral_7b() -> transformers.PretrainedConfig:
    """Mistral-7B (v0.1): 32 layers, 8 KV heads x 128, every layer sliding over 4096."""
    return transformers.MistralConfig(
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        sliding_window=4096,
        max_position_embeddings=32768,
        **SMALL,
    )


MODELS = {"gemma-4-31b": gemma4_31b, "gemma-4-e2b": gemma4_e2b, "gemma-3-27b": gemma3_27b, "mistral-7b": mistral_7b}


def attention_layers(config: transformers.PretrainedConfig) -> list[Attention]:
    """The model's Attention layers, built by NovaInfer's model class for config."""
    arch = type(config).__name__.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")
    config.architectures = [arch]
    model = get_model_class(config)(config)
    return [m for m in model.modules() if isinstance(m, Attention)]


def capacity_row(name: str, budget: int, block_size: int, seq_len: int, itemsize: int) -> dict:
    """One model's capacity before and after at budget bytes."""
    layers = attention_layers(MODELS[name]())
    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    whole_bytes = kv_bytes_per_block(layers, block_size, dtype)
    whole_blocks = budget // whole_bytes
    layout = kv_layout_of(layers, block_size)
    blocks = budget // layout.bytes_per_block(block_size, itemsize)
    longest = layout.max_context(blocks)
    per_seq_before = -(-seq_len // block_size)
    return dict(
        model=name,
        layers=len(layers),
        caches=sum(a.kv_source is None for a in layers),
        groups=describe_groups(layout),
        before=whole_blocks * block_size,
        after=longest,
        held_before=whole_blocks // per_seq_before * seq_len,
        held_after=layout.tokens_held(blocks, seq_len),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=40.0, help="KV cache memory (bf16 K/V)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32768, help="context of each sequence for the 'held' columns")
    parser.add_argument("--tiny", action="store_true", help="a 1 GiB budget and 8k sequences (a quick run)")
    args = parser.parse_args()
    if args.tiny:
        args.budget_gib, args.seq_len = 1.0, 8192
    budget = int(args.budget_gib * 2**30)
    rows = [capacity_row(name, budget, args.block_size, args.seq_len, 2) for name in MODELS]
    print(
        f"KV capacity at {args.budget_gib:g} GiB, bf16 K/V, {args.block_size}-token blocks "
        f"(before: every layer keeps the whole context; after: grouped layout)"
    )
    head = f"{'model':<13} {'layers':>6} {'caches':>6} {'before':>10} {'after (1 seq)':>14} {'x':>6} "
    head += f"{'held@' + str(args.seq_len) + ' before':>20} {'after':>10} {'x':>6}  groups"
    print(head)
    for r in rows:
        after = "unbounded" if r["after"] is None else str(r["after"])
        ratio = "-" if r["after"] is None else f"{r['after'] / r['before']:.2f}"
        print(
            f"{r['model']:<13} {r['layers']:>6} {r['caches']:>6} {r['before']:>10} {after:>14} {ratio:>6} "
            f"{r['held_before']:>20} {r['held_after']:>10} {r['held_after'] / max(1, r['held_before']):>6.2f}  "
            f"{r['groups']}"
        )


if __name__ == "__main__":
    main()

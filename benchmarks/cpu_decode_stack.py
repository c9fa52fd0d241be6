"""A decode step of the default model on the CPU (forward + logits) with the C decoder stack on and off
(layers/quantization/cpu_decoder.py), in one process, taking turns every round so a load that comes and
goes on a shared machine hits both alike. Each round: the median over --steps steps, continuing one context
per row (starting after --context cached tokens). Example:
    python benchmarks/cpu_decode_stack.py --rows 1 --context 128 --rounds 6
    python benchmarks/cpu_decode_stack.py --scales   # C stack on: float16 vs float32 scales (issue 18 round 6)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1, help="sequences decoded together (< 64 for the C stack)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--scales", action="store_true",
                    help="instead: C stack on, float16 vs float32 scales and zeros (two copies of the weights)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from novainfer.kernels.cpu import repack as gguf_repack

    if args.scales:
        variants = {}
        for key, f16 in (("f16", True), ("f32", False)):
            gguf_repack.FP16_SCALES = f16
            variants[key] = (Decoder(args), True)
        gguf_repack.FP16_SCALES = True
    else:
        dec = Decoder(args)
        variants = {"on": (dec, True), "off": (dec, False)}
    res: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, (dec, on) in variants.items():
            res[key].append(statistics.median(dec.step(on) for _ in range(args.steps)) * 1e3)
    what = "scales" if args.scales else "C stack"
    for key, ms in res.items():
        print(f"rows={args.rows} {what} {key:3s}: ms/step per round " + " ".join(f"{x:.2f}" for x in ms))
    a, b = list(res)
    ratio = [y / x for x, y in zip(res[a], res[b])]
    print(f"{b} / {a} per round: {min(ratio):.2f}-{max(ratio):.2f}x (median {statistics.median(ratio):.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "context": args.context, **res}, f, indent=2)


class Decoder:
    """The default model (quantized CPU path, bf16 paged cache) continuing one context per row."""

    def __init__(self, args: argparse.Namespace) -> None:
        from novainfer.attention import cpu_backend
        from novainfer.attention.metadata import AttentionMetadata, attention_metadata
        from novainfer.layers.attention import Attention
        from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
        from novainfer.loader.default_model import default_model_path
        from novainfer.loader.model_loader import load_hf_config, load_model
        from novainfer.worker.kv_cache import allocate_kv_cache

        path, self.bs, self.m = default_model_path(), 16, args.rows
        model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
        max_len = args.context + args.steps * args.rounds * 2 + 1
        per_seq = (max_len + self.bs - 1) // self.bs
        allocate_kv_cache([x for x in model.modules() if isinstance(x, Attention)], self.m * per_seq, self.bs,
                          torch.bfloat16, torch.device("cpu"), cpu_backend)
        self.tables = (torch.arange(self.m)[:, None] * per_seq + torch.arange(per_seq)).to(torch.int32)
        self.model, self.stack, self.meta_cls, self.ctx = model, model.model.cpu_decoder, AttentionMetadata, attention_metadata
        with torch.inference_mode(), attention_metadata(AttentionMetadata(
                query_start_loc=torch.tensor([0, args.context], dtype=torch.int32),
                seq_lens=torch.tensor([args.context], dtype=torch.int32), slot_mapping=torch.arange(args.context),
                block_tables=self.tables[:1], max_query_len=args.context, max_seq_len=args.context)):
            model(torch.randint(0, 1000, (args.context,)), torch.arange(args.context))  # row 0's context (others: zeros)
        self.pos = args.context

    def step(self, on: bool) -> float:
        """Seconds of one decode step (forward + logits), the C stack on or off."""
        model, m, bs, pos = self.model, self.m, self.bs, self.pos
        model.model.cpu_decoder = self.stack if on else None
        slots = self.tables[:, pos // bs].long() * bs + pos % bs
        meta = self.meta_cls(query_start_loc=torch.arange(m + 1, dtype=torch.int32),
                             seq_lens=torch.full((m,), pos + 1, dtype=torch.int32), slot_mapping=slots,
                             block_tables=self.tables, max_query_len=1, max_seq_len=pos + 1)
        ids = torch.randint(0, model.config.vocab_size, (m,))
        self.pos += 1
        with torch.inference_mode(), self.ctx(meta):
            t0 = time.perf_counter()
            model.compute_logits(model(ids, torch.full((m,), pos)))
            return time.perf_counter() - t0


if __name__ == "__main__":
    main()

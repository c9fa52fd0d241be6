"""Accuracy of quantized-weight inference, measured as llama.cpp measures its quantizations: mean KL
divergence of the next-token distribution against the float32 dequantized reference, and top-1 agreement,
over teacher-forced positions of real English text (a license text shipped with a package), in
independent chunks of --ctx tokens. llama.cpp's own figures on the same file and tokens when llama_cpp
is installed. Example:
    python benchmarks/quant_accuracy.py --positions 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def english_text() -> str:
    """The Apache-2.0 license text that ships with transformers (about 2,400 tokens), no network needed."""
    import importlib.metadata

    dist = importlib.metadata.distribution("transformers")
    for f in dist.files or []:
        if f.name == "LICENSE":
            return dist.locate_file(f).read_text()
    raise FileNotFoundError("transformers' LICENSE text is not installed")


def novainfer_logits(path: str, chunks: list[list[int]], quantized: bool, step: int | None = None) -> torch.Tensor:
    """Float32 logits of every position of every chunk: GGUF kept quantized (the default CPU path: float32
    activations here, bfloat16 KV) or the float32 dequantized reference with a float32 cache. A chunk goes in
    as one prefill, or with `step`, in steps of that many tokens over the cache, as decode and verify steps go
    (the GEMMs give a row the same bits in either kernel; what differs is the attention path over the cache)."""
    from novainfer.attention import cpu_backend
    from novainfer.attention.metadata import AttentionMetadata, attention_metadata
    from novainfer.layers.attention import Attention
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.model_loader import load_hf_config, load_model

    hf_config = load_hf_config(path)
    cpu = torch.device("cpu")
    model = load_model(path, hf_config, torch.float32, cpu, quant_config=GGUFCPUConfig() if quantized else None)
    kv_dtype = torch.bfloat16 if quantized else torch.float32
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    out = []
    with torch.inference_mode():
        for ids in chunks:
            n, bs = len(ids), 16
            blocks = (n + bs - 1) // bs
            for layer in layers:
                shape = (blocks, bs, layer.num_kv_heads, layer.head_dim)
                layer.k_cache, layer.v_cache = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
                layer.backend = cpu_backend
            for start in range(0, n, step or n):
                end = min(n, start + (step or n))
                q = end - start
                meta = AttentionMetadata(
                    query_start_loc=torch.tensor([0, q], dtype=torch.int32),
                    seq_lens=torch.tensor([end], dtype=torch.int32),
                    slot_mapping=torch.arange(start, end),
                    block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                    max_query_len=q,
                    max_seq_len=end,
                    query_start_loc_cpu=[0, q],
                    seq_lens_cpu=[end],
                )
                with attention_metadata(meta):
                    hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end))
                out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def llamacpp_logits(path: str, chunks: list[list[int]], threads: int) -> torch.Tensor:
    """llama.cpp's logits for the same token ids (logits_all), each chunk in a fresh context."""
    from llama_cpp import Llama

    ctx = max(len(c) for c in chunks)
    llm = Llama(path, n_ctx=ctx, n_batch=ctx, n_threads=threads, logits_all=True, verbose=False)
    out = []
    for ids in chunks:
        llm.reset()
        llm.eval(ids)
        out.append(torch.from_numpy(llm.scores[: len(ids)].copy()).float())
    return torch.cat(out)


def kl_and_top1(ref: torch.Tensor, test: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || test) of the softmax distributions per position, and how often their argmax agrees."""
    ref_lp, test_lp = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1)
    return kl.mean().item(), (ref.argmax(-1) == test.argmax(-1)).double().mean().item()


def against_float32_reference(path: str, chunks: list[list[int]]) -> tuple[tuple[float, float], tuple | None]:
    """(KL, top-1) of the file kept quantized, and of llama.cpp on the same file (None without llama_cpp), each
    against the float32 reference on the file's own dequantized weights (the tests' check of a quantized GGUF)."""
    ref = novainfer_logits(path, chunks, quantized=False)
    ours = kl_and_top1(ref, novainfer_logits(path, chunks, quantized=True))
    try:
        theirs = kl_and_top1(ref, llamacpp_logits(path, chunks, 1))
    except ImportError:
        theirs = None
    return ours, theirs


def make_chunks(path: str, positions: int, ctx: int) -> list[list[int]]:
    from novainfer.loader.model_loader import load_tokenizer

    ids = load_tokenizer(path).encode(english_text())
    while len(ids) < positions + 1:
        ids = ids + ids
    ids = ids[:positions]
    return [ids[i : i + ctx] for i in range(0, len(ids), ctx)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--decode-step",
        type=int,
        default=8,
        help="tokens per step for the decode-path row (under 16: the few-row GEMM of a decode step)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp's figures out")
    args = ap.parse_args()
    from novainfer.loader.model_loader import resolve_model_path

    path = resolve_model_path(args.model)
    chunks = make_chunks(path, args.positions, args.ctx)
    t0 = time.perf_counter()
    ref = novainfer_logits(path, chunks, quantized=False)
    kl, top1 = kl_and_top1(ref, novainfer_logits(path, chunks, quantized=True))
    dkl, dtop1 = kl_and_top1(ref, novainfer_logits(path, chunks, quantized=True, step=args.decode_step))
    r = {
        "model": os.path.basename(path),
        "positions": ref.shape[0],
        "ctx": args.ctx,
        "novainfer_kl": kl,
        "novainfer_top1": top1,
        "novainfer_decode_kl": dkl,
        "novainfer_decode_top1": dtop1,
    }
    try:
        if args.no_llamacpp:
            raise ImportError
        import llama_cpp

        lc = llamacpp_logits(path, chunks, args.threads)
        r["llamacpp_version"] = llama_cpp.__version__
        r["llamacpp_kl"], r["llamacpp_top1"] = kl_and_top1(ref, lc)
    except ImportError:
        print("llama_cpp is not installed: llama.cpp's figures are left out (see README)")
    r["seconds"] = time.perf_counter() - t0
    print(
        f"\nreference: float32 dequantized weights, float32 KV; {r['positions']} teacher-forced positions of "
        f"the Apache-2.0 text in chunks of {args.ctx}\n| engine | mean KL | top-1 agreement |\n|---|---|---|"
    )
    from novainfer.kernels.cpu.qgemm import PANEL_MIN_ROWS

    kernel = "few-row" if args.decode_step < PANEL_MIN_ROWS else "panel"
    print(f"| NovaInfer, prefill path (panel GEMM, int16-rounded activations, bf16 KV) | {kl:.5f} | {top1:.2%} |")
    print(
        f"| NovaInfer, decode path (steps of {args.decode_step}: {kernel} GEMM, int16-rounded activations, bf16 KV) "
        f"| {dkl:.5f} | {dtop1:.2%} |"
    )
    if "llamacpp_kl" in r:
        print(f"| llama.cpp {r['llamacpp_version']} | {r['llamacpp_kl']:.5f} | {r['llamacpp_top1']:.2%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()

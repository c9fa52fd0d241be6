"""GGUF kept quantized on one GPU (layers/quantization/gguf_gpu.py), in one run: a Qwen2.5-7B-shape file in
llama.cpp's Q4_K_M mix with random blocks is written on the spot (benchmarks/gguf_checkpoint.py, a byte-level
tokenizer: no model package or hub needed), each kernel is checked on the 7B layer shapes against the torch
reference and timed against a bf16 F.linear of the same shape, then the file runs end to end with LLM(path), kept
quantized (the default: GGUFGPULinearMethod on a GPU, the CPU method on a CPU) and dequantized to bf16
(quantization="none"), each in its own process: weight bytes on the GPU, batch-1 decode, 32 concurrent streams,
bench-shape throughput. One table at the end.

    python benchmarks/gguf_gpu.py --out /tmp/gguf-gpu                  # on an H100/H200 (gguf installed)
    python benchmarks/gguf_gpu.py --part kernels                       # or one part at a time
    TRITON_INTERPRET=1 python benchmarks/gguf_gpu.py --tiny             # the same steps on the CPU, tiny shapes

Kernel times are device times: each call captured in a CUDA graph, over enough weight copies that none is read
from L2 (benchmarks/quant_gpu.py's device_us). At one row every GEMV tile candidate of kernels/gguf_gemm.py is also
timed and checked, and the best printed (to paste into GEMV_DEFAULT). The Q4_K_M types (Q4_K, Q6_K) run on every
layer shape; Q4_0, Q4_1, Q8_0 and Q5_K on o_proj's (the second shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.quant_gpu import SHAPES_7B, device_us, rel  # noqa: E402

SHAPES_TINY = [("qkv_proj", 256, 384), ("down_proj", 512, 256)]
MIX_TYPES = ["Q4_K", "Q6_K"]
OTHER_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_K"]
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
MAX_REL = 1e-2  # bf16 output rounding (and the GEMM's bf16 tile); float32 accumulation


def random_weight(qtype: str, n: int, k: int, device: torch.device, rng: np.random.Generator):
    """A random [n, k] weight of a GGML type in the GPU layout, its blocks' weights of std ~0.02: random quants,
    float16 block factors set (the K-quants' 6-bit sub-scales random). Returns (GGUFWeight, blocks)."""
    from gguf import GGMLQuantizationType as T

    from novainfer.kernels.cpu.repack import BLOCK
    from novainfer.kernels.gguf_gemm import dequantize
    from novainfer.layers.quantization.gguf_gpu_layout import gpu_layout

    per, nbytes = BLOCK[T[qtype]]
    b = np.frombuffer(rng.bytes(n * (k // per) * nbytes), np.uint8).reshape(n, k // per, nbytes).copy()
    for off in F16_FIELDS[qtype]:
        b[..., off : off + 2] = np.full((n, k // per, 1), 1e-3, np.float16).view(np.uint8)
    w = gpu_layout(b.reshape(n, -1), T[qtype], (n, k), device)
    probe = dequantize(w.select_rows(torch.arange(min(n, 64), device=device)))
    d = 0.02 / max(probe.float().std().item(), 1e-12) * 1e-3  # rescale the block factors: std ~0.02
    for off in F16_FIELDS[qtype]:
        b[..., off : off + 2] = np.full((n, k // per, 1), d, np.float16).view(np.uint8)
    return gpu_layout(b.reshape(n, -1), T[qtype], (n, k), device), b.reshape(n, -1)


def check_reference(blocks: np.ndarray, qtype: str, w) -> bool:
    """The torch reference dequantizer equals gguf.quants.dequantize on the weight's first rows (CPU)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize as gguf_dequantize

    from novainfer.kernels.gguf_gemm import dequantize

    rows = min(16, w.shape[0])
    want = np.asarray(gguf_dequantize(blocks[:rows], T[qtype]), np.float32).reshape(rows, -1)
    got = dequantize(w.select_rows(torch.arange(rows, device=w.qweight.device))).cpu().numpy()
    return bool(np.array_equal(got, want))


def kernel_rows(shapes, rows: list[int], device: torch.device, iters: int) -> list[dict]:
    """Each layer shape, type and row count: the GGUF kernel against x @ dequantize(w)^T and bf16 F.linear's time."""
    from novainfer.kernels import gguf_gemm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 tl.dot is wrong
    rng = np.random.default_rng(0)
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, k, n in shapes:
        w16 = [(torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)]
        for qtype in MIX_TYPES + (OTHER_TYPES if name == shapes[1][0] else []):  # o_proj of the 7B
            w, blocks = random_weight(qtype, n, k, device, rng)
            ref_ok = check_reference(blocks, qtype, w)
            ref = gguf_gemm.dequantize(w)
            copies = [w]
            for m in rows:
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                want = x.float() @ ref.T
                if m == 1:  # the int8 GEMV's exact product is over x's int8 rounding (as llama.cpp's MMVQ)
                    xq, dx, _ = gguf_gemm.quantize_q8_reference(x)
                    want = (xq.float().view(-1, 32) * dx[:, None]).view(1, -1) @ ref.T
                err = rel(gguf_gemm.gguf_matmul(x, [w]), want)
                err_x = rel(gguf_gemm.gguf_matmul(x, [w]), x.float() @ ref.T)

                def quant(i: int, tiles=None):
                    while len(copies) <= i:
                        copies.append(w.map(torch.clone, w.shape[0]))  # L2 holds none
                    if tiles is not None:
                        return lambda: gguf_gemm.gguf_gemv(x, copies[i], tiles=tiles)
                    return lambda: gguf_gemm.gguf_matmul(x, [copies[i]])

                def bf16(i: int):
                    while len(w16) <= i:
                        w16.append(w16[0].clone())
                    return lambda: torch.nn.functional.linear(x, w16[i])

                us = device_us(quant, w.nbytes(), device, iters)
                us16 = device_us(bf16, 2 * n * k, device, iters)
                row = dict(layer=name, qtype=qtype, m=m, k=k, n=n, us=us, bf16_us=us16, rel=err, ref_ok=ref_ok)
                row["rel_float_x"] = err_x
                if m == 1 and device.type == "cuda":  # the GEMV tile sweep
                    sweep = {}
                    for tiles in gguf_gemm.GEMV_CANDIDATES:
                        e = rel(gguf_gemm.gguf_gemv(x, w, tiles=tiles), want)
                        sweep[str(tiles)] = (device_us(lambda i: quant(i, tiles), w.nbytes(), device, iters), e)
                    best = min(sweep, key=lambda t: sweep[t][0])
                    row.update(
                        best_tiles=best, best_us=sweep[best][0], sweep_ok=all(e <= MAX_REL for _, e in sweep.values())
                    )
                out.append(row)
                print(
                    f"{name:12s} {qtype:5s} M={m:5d} {us:9.1f} us  bf16 {us16:9.1f} us  x{us16 / us:5.2f}  "
                    f"rel {err:.1e} (float x {err_x:.1e})"
                    + (f"  best GEMV {row['best_tiles']} {row['best_us']:.1f} us" if "best_tiles" in row else ""),
                    flush=True,
                )
    return out


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and of the GGUF parts its layers hold (each once: a tied lm_head shares)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
            packed = getattr(p, "packed", None)  # the GPU method's parts (a list), the CPU method's PackedWeight
            if packed is not None:
                total += sum(part.nbytes() for part in (packed if isinstance(packed, list) else [packed]))
    return total


def e2e_one(path: str, mode: str, args: argparse.Namespace) -> dict:
    """One mode in this process: load time, weight bytes, batch-1 decode, 32 streams, bench-shape throughput."""
    from benchmarks.latency import nova_after_first
    from benchmarks.throughput import make_workload
    from novainfer import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # an HF tokenizer beside the file: transformers 5.17 (the GPU machine's) cannot convert the file's byte-level one
    tok_dir = path + ".tokenizer"
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        from benchmarks.checkpoints import word_level_tokenizer
        from novainfer.loader.gguf_loader import load_gguf_config

        word_level_tokenizer(load_gguf_config(path).vocab_size).save_pretrained(tok_dir)
    kw = dict(device=device, max_model_len=args.max_model_len, tokenizer=tok_dir)
    if device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if mode == "dequantized":
        kw["quantization"] = "none"
    t0 = time.perf_counter()
    llm = LLM(path, **kw)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    model = engine.executor.workers[0].model_runner.model
    gpu = dict(gpu_total_bytes=torch.cuda.get_device_properties(0).total_memory) if device == "cuda" else {}
    if device == "cuda":  # the whole footprint once loaded: weights, KV cache, graphs, the allocator's reserve
        gpu.update(gpu_reserved_bytes=torch.cuda.memory_reserved(), gpu_peak_bytes=torch.cuda.max_memory_reserved())
    vocab = model.config.vocab_size
    prompt = make_workload(1, 128, 1, vocab, 1)[0][0]
    nova_after_first(llm, prompt, 8)  # warm
    secs = min(nova_after_first(llm, prompt, args.decode_tokens) for _ in range(args.repeat))

    def tok_s(prompts: list[list[int]], outs: list[int]) -> float:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)

    tok_s(*make_workload(2, 16, 4, vocab, 2))  # warm the batched shapes
    streams = tok_s(*make_workload(args.streams, 128, args.stream_tokens, vocab, 3))
    bench = tok_s(*make_workload(args.num_prompts, args.input_len, args.output_len, vocab, 0))
    method = getattr(model.model.layers[0].self_attn.qkv_proj, "quant_method", None)
    return dict(
        method=type(method).__name__ if method is not None else "dense",  # GGUFGPULinearMethod on a GPU
        load_s=load_s,
        weight_bytes=model_weight_bytes(model),
        file_bytes=os.path.getsize(path),
        kv_blocks=engine.engine_core.num_blocks,
        **gpu,
        decode_tok_s=(args.decode_tokens - 1) / secs,
        streams_tok_s=streams,
        bench_tok_s=bench,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and workloads (the CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--part", default="all", choices=["all", "kernels", "e2e"])
    ap.add_argument("--out", default="/tmp/novainfer-gguf-gpu")
    ap.add_argument("--path", default=None, help="the GGUF to write (reused when present)")
    ap.add_argument("--modes", default="quantized,dequantized")
    ap.add_argument("--num-prompts", type=int, default=None, help="bench shape: 256 prompts of 100-1024 tokens")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="--part kernels: these row counts only")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--shape", default="qwen2.5-7b", help="benchmarks/gguf_checkpoint.py's SHAPES: qwen2.5-7b, -32b")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="e2e: the engine's GPU budget")
    ap.add_argument("--e2e-one", default=None, help=argparse.SUPPRESS)  # internal: one mode, JSON on stdout
    args = ap.parse_args()
    if args.tiny:
        args.num_prompts, args.streams = args.num_prompts or 2, min(args.streams, 3)
        args.input_len, args.output_len = args.input_len or 16, args.output_len or 4
        args.decode_tokens, args.repeat, args.max_model_len = args.decode_tokens or 4, 1, 256
        args.stream_tokens = args.stream_tokens or 4
    args.num_prompts = args.num_prompts or 256
    args.decode_tokens = args.decode_tokens or 256
    args.stream_tokens = args.stream_tokens or 256
    os.makedirs(args.out, exist_ok=True)
    shape = "tiny" if args.tiny else args.shape
    path = args.path or os.path.join(args.out, f"{shape}-random-q4_k_m.gguf")
    if args.e2e_one:
        print("E2E " + json.dumps(e2e_one(path, args.e2e_one, args)), flush=True)
        return
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.part in ("all", "e2e") and not os.path.exists(path):
        from benchmarks.gguf_checkpoint import SHAPES, write_qwen2_q4_k_m

        t0 = time.perf_counter()
        write_qwen2_q4_k_m(path, SHAPES[shape], byte_tokenizer=True)
        result["write_s"] = time.perf_counter() - t0
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {result['write_s']:.1f} s", flush=True)
    if args.part in ("all", "kernels"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes, rows = (SHAPES_TINY, [1, 20]) if args.tiny else (SHAPES_7B, [1, 4, 8, 16, 32, 256, 2048])
        rows = args.rows or rows
        result["kernels"] = kernel_rows(shapes, rows, device, 1 if args.tiny else 50)
        bad = [
            f"{r['layer']} {r['qtype']} M={r['m']}"
            for r in result["kernels"]
            if r["rel"] > MAX_REL or not r["ref_ok"] or not r.get("sweep_ok", True)
        ]
        print("kernel checks: " + (f"FAILED {bad}" if bad else f"all within {MAX_REL} of the torch reference"))
        result["kernel_failures"] = bad
    if args.part in ("all", "e2e"):
        result["e2e"] = {}
        for mode in args.modes.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--e2e-one", mode, "--path", path, "--out", args.out]
            for flag in ("num_prompts", "input_len", "output_len", "streams", "stream_tokens", "decode_tokens"):
                if getattr(args, flag):
                    cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
            cmd += ["--repeat", str(args.repeat), "--max-model-len", str(args.max_model_len)]
            cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E ")]
            if proc.returncode or not line:
                print(f"{mode}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                continue
            result["e2e"][mode] = json.loads(line[0][4:])
            print(mode, result["e2e"][mode], flush=True)
    print_table(result, shape)
    with open(os.path.join(args.out, "gguf_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    if result.get("kernel_failures"):
        sys.exit(1)


def print_table(result: dict, shape: str) -> None:
    """The kernel rows at decode and prefill sizes, then the end-to-end rows, each against bf16."""
    print(f"\n{result['device']}: random {shape}-shape Q4_K_M GGUF")
    kernels = result.get("kernels", [])
    if kernels:
        print(f"{'layer':12s} | {'type':5s} | {'M':>5s} | {'GGUF us':>9s} | {'bf16 us':>9s} | {'x bf16':>6s} | rel err")
        for r in kernels:
            print(
                f"{r['layer']:12s} | {r['qtype']:5s} | {r['m']:5d} | {r['us']:9.1f} | {r['bf16_us']:9.1f} | "
                f"{r['bf16_us'] / r['us']:6.2f} | {r['rel']:.1e}"
            )
    e2e = result.get("e2e", {})
    if e2e:
        base = e2e.get("dequantized")
        print(
            f"\n{'mode':12s} | {'layer method':20s} | {'weights MB':>10s} | {'load s':>6s} | "
            f"{'batch-1 tok/s':>13s} | "
            f"{'32 streams tok/s':>16s} | {'bench tok/s':>11s} | x dequantized (batch-1, 32 streams, bench)"
        )
        for mode, r in e2e.items():
            ratio = ""
            if base:
                ratio = ", ".join(f"{r[k] / base[k]:.2f}" for k in ("decode_tok_s", "streams_tok_s", "bench_tok_s"))
            print(
                f"{mode:12s} | {r['method']:20s} | {r['weight_bytes'] / 1e6:10.1f} | {r['load_s']:6.1f} | "
                f"{r['decode_tok_s']:13.1f} | "
                f"{r['streams_tok_s']:16.1f} | {r['bench_tok_s']:11.1f} | {ratio}"
            )
        for mode, r in e2e.items():
            if "gpu_reserved_bytes" in r:
                print(
                    f"{mode}: file {r['file_bytes'] / 1e9:.2f} GB, weights on the GPU {r['weight_bytes'] / 1e9:.2f} GB, "
                    f"all GPU memory reserved once loaded {r['gpu_reserved_bytes'] / 1e9:.2f} GB (peak "
                    f"{r['gpu_peak_bytes'] / 1e9:.2f}) of {r['gpu_total_bytes'] / 1e9:.1f}, KV blocks {r['kv_blocks']}"
                )


if __name__ == "__main__":
    main()

"""Pre-quantized formats on one GPU, in one run: the kernels against their torch references and bf16 on
Qwen2.5-7B's layer shapes, then the whole model (random weights packed in each format, load_format dummy)
in bf16, block FP8, compressed-tensors FP8 and INT4: bench-shape throughput, batch-1 decode, weight bytes.

    python benchmarks/quant_gpu.py --out /tmp/quant          # on an H100/H200
    TRITON_INTERPRET=1 python benchmarks/quant_gpu.py --tiny  # the same steps on the CPU, tiny shapes

Targets (issue 38), printed beside the results: INT4 batch-1 >= 2.5x bf16 and bench shape >= bf16; block FP8
bench shape >= 1.1x bf16 and batch-1 >= 1.6x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.checkpoints import resolve_model  # noqa: E402

# name, K (input), N (output): Qwen2.5-7B's dense layers, one rank
SHAPES_7B = [
    ("qkv_proj", 3584, 4608),
    ("o_proj", 3584, 3584),
    ("gate_up_proj", 3584, 37888),
    ("down_proj", 18944, 3584),
]
SHAPES_TINY = [("qkv_proj", 256, 384), ("down_proj", 512, 256)]
FORMATS = {  # name -> the quantization_config written into the random model's config.json
    "bf16": None,
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "ct-fp8": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    },
    "int4-gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
}
TARGETS = {"fp8-block": (1.1, 1.6), "int4-gptq": (1.0, 2.5)}  # (bench shape, batch-1) x bf16
# relative error against the torch reference on the GPU (bf16 output rounding, float32 accumulation); under the CPU
# interpreter the float8 cast truncates where CUDA rounds, so the fp8 figure is only printed there
MAX_REL = {"fp8-block": 1e-2, "int4": 1e-2}


def timed(fn, iters: int) -> float:
    """Median seconds of fn (CUDA events on the GPU)."""
    fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kernel_rows(shapes, rows: list[int], device: torch.device, iters: int) -> list[dict]:
    """Each layer shape and row count: bf16 F.linear, block FP8 and INT4 (g128) kernels; rel err vs torch refs."""
    from novainfer.kernels.fp8_block import GEMV_MAX_M as FP8_GEMV, fp8_block_gemm, fp8_block_gemv
    from novainfer.kernels.fp8_block import per_token_group_quant
    from novainfer.kernels.int4_gemm import GEMV_MAX_M as INT4_GEMV, int4_gemm, int4_gemv
    from novainfer.layers.quantization.fp8_block import block_reference, expand_blocks
    from novainfer.layers.quantization.int4 import dequantize_int4, pack_int32

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, k, n in shapes:
        w = torch.randn(n, k, device=device, generator=g) * 0.02
        # block FP8 weight
        nb, kb = -(-n // 128), -(-k // 128)
        pad = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
        ws = pad.abs().amax(dim=(1, 3)) / 448
        wq = (w / expand_blocks(ws, (128, 128), (n, k))).to(torch.float8_e4m3fn)
        # INT4 weight, symmetric groups of 128
        wg = w.T.reshape(k // 128, 128, n)
        s4 = wg.abs().amax(1) / 7
        codes = (wg / s4[:, None]).round().clamp(-8, 7).add(8).reshape(k, n).to(torch.uint8)
        q4, z4d = pack_int32(codes), torch.full(s4.shape, 8, dtype=torch.uint8, device=device)
        s4d = s4.half() if device.type == "cuda" else s4  # GPTQ's float16 scales, as the layer keeps them
        w16 = w.to(dtype)
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            t_bf16 = timed(lambda: torch.nn.functional.linear(x, w16), iters)
            if m <= FP8_GEMV:
                fp8 = lambda: fp8_block_gemv(x, wq, ws, (128, 128))  # noqa: E731
            else:
                fp8 = lambda: fp8_block_gemm(*per_token_group_quant(x, 128), wq, ws, (128, 128), dtype)  # noqa: E731
            int4 = (
                (lambda: int4_gemv(x, q4, s4d, z4d, 128))
                if m <= INT4_GEMV
                else (lambda: int4_gemm(x, q4, s4d, z4d, 128))
            )
            ref8 = block_reference(x, wq, ws, (128, 128))
            ref4 = x.float() @ dequantize_int4(q4, s4d, z4d, 128)
            row = dict(layer=name, m=m, k=k, n=n, bf16_us=t_bf16 * 1e6)
            for fmt, fn, ref, nbytes in (("fp8-block", fp8, ref8, n * k), ("int4", int4, ref4, n * k // 2)):
                t = timed(fn, iters)
                row[f"{fmt}_us"] = t * 1e6
                row[f"{fmt}_x"] = t_bf16 / t
                row[f"{fmt}_gbs"] = nbytes / t / 1e9
                row[f"{fmt}_rel"] = rel(fn(), ref)
                row[f"{fmt}_ok"] = device.type != "cuda" or row[f"{fmt}_rel"] <= MAX_REL[fmt]
            out.append(row)
            print(
                f"{name:13s} M={m:5d} bf16 {t_bf16 * 1e6:8.1f} us | fp8-block {row['fp8-block_us']:8.1f} us "
                f"({row['fp8-block_x']:.2f}x, rel {row['fp8-block_rel']:.1e}) | int4 {row['int4_us']:8.1f} us "
                f"({row['int4_x']:.2f}x, {row['int4_gbs']:.0f} GB/s, rel {row['int4_rel']:.1e})",
                flush=True,
            )
    return out


def model_folder(base: str, fmt: str, out_dir: str) -> str:
    """A config-only copy of the random model with fmt's quantization_config."""
    import shutil

    path = os.path.join(out_dir, f"model-{fmt}")
    if os.path.exists(path):
        shutil.rmtree(path)
    shutil.copytree(base, path, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    if FORMATS[fmt] is not None:
        cfg["quantization_config"] = FORMATS[fmt]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def e2e_one(path: str, args: argparse.Namespace) -> dict:
    """One format in this process: weight bytes, batch-1 decode, bench-shape throughput."""
    from benchmarks.latency import nova_after_first
    from benchmarks.throughput import make_workload
    from novainfer import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(load_format="dummy", device=device, max_model_len=args.max_model_len)
    if device == "cuda":
        kw["gpu_memory_utilization"] = 0.85
    llm = LLM(path, **kw)
    model = llm.llm_engine.executor.workers[0].model_runner.model
    linear = sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if hasattr(m, "quant_method") and type(m).__name__.endswith("Linear")
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if t is not getattr(m, "bias", None)
    )
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(128)]
    nova_after_first(llm, prompt, 8)  # warm
    secs = min(nova_after_first(llm, prompt, args.decode_tokens) for _ in range(args.repeat))
    decode = (args.decode_tokens - 1) / secs
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, 0)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=0) for o in outs]
    llm.generate([{"prompt_token_ids": prompts[0]}], params[:1], use_tqdm=False)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    return dict(linear_bytes=linear, param_bytes=total, decode_tok_s=decode, bench_tok_s=tokens / elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and workloads (the CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--part", default="all", choices=["all", "kernels", "e2e"])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default="/tmp/novainfer-quant")
    ap.add_argument("--num-prompts", type=int, default=None, help="bench shape: 256 prompts of 100-1024 tokens")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--e2e-one", default=None, help=argparse.SUPPRESS)  # internal: one format, JSON on stdout
    args = ap.parse_args()
    if args.tiny:
        args.num_prompts = args.num_prompts or 2
        args.input_len, args.output_len = args.input_len or 16, args.output_len or 4
        args.decode_tokens, args.repeat, args.max_model_len = args.decode_tokens or 4, 1, 256
    args.num_prompts = args.num_prompts or 256
    args.decode_tokens = args.decode_tokens or 256
    if args.e2e_one:
        print("E2E " + json.dumps(e2e_one(args.e2e_one, args)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.part in ("all", "kernels"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes, rows = (SHAPES_TINY, [1, 20]) if args.tiny else (SHAPES_7B, [1, 4, 32, 256, 4096])
        result["kernels"] = kernel_rows(shapes, rows, device, 1 if args.tiny else 50)
        bad = [f"{r['layer']} M={r['m']} {f}" for r in result["kernels"] for f in MAX_REL if not r[f"{f}_ok"]]
        print("kernel checks: " + (f"FAILED {bad}" if bad else f"all within {MAX_REL} of the torch references"))
        result["kernel_failures"] = bad
    if args.part in ("all", "e2e"):
        base = resolve_model("random:qwen3-dense-small" if args.tiny else "random:qwen2.5-7b")
        result["e2e"] = {}
        for fmt in args.formats.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--e2e-one", model_folder(base, fmt, args.out)]
            cmd += ["--num-prompts", str(args.num_prompts), "--decode-tokens", str(args.decode_tokens)]
            cmd += ["--repeat", str(args.repeat), "--max-model-len", str(args.max_model_len)]
            for flag, v in (("--input-len", args.input_len), ("--output-len", args.output_len)):
                if v:
                    cmd += [flag, str(v)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E ")]
            if proc.returncode or not line:
                print(f"{fmt}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                continue
            result["e2e"][fmt] = json.loads(line[0][4:])
            print(fmt, result["e2e"][fmt], flush=True)
            gc.collect()
        print_table(result, "qwen3-dense-small" if args.tiny else "Qwen2.5-7B")
    with open(os.path.join(args.out, "quant_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    if result.get("kernel_failures"):
        sys.exit(1)


def print_table(result: dict, shape: str) -> None:
    e2e = result.get("e2e", {})
    base = e2e.get("bf16")
    print(f"\n{result['device']}: random {shape} weights packed in each format (load_format dummy)")
    print(
        f"{'format':10s} | {'linear GB':>9s} | {'bench tok/s':>11s} | {'x bf16':>6s} | {'batch-1 tok/s':>13s} | "
        f"{'x bf16':>6s} | target (bench, batch-1)"
    )
    for fmt, r in e2e.items():
        xb = r["bench_tok_s"] / base["bench_tok_s"] if base else float("nan")
        xd = r["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
        tgt = TARGETS.get(fmt)
        tgt_s = f">= {tgt[0]}x, >= {tgt[1]}x" if tgt else ""
        if tgt and base:
            tgt_s += "  met" if xb >= tgt[0] and xd >= tgt[1] else "  NOT met"
        print(
            f"{fmt:10s} | {r['linear_bytes'] / 1e9:9.2f} | {r['bench_tok_s']:11.1f} | {xb:6.2f} | "
            f"{r['decode_tok_s']:13.1f} | {xd:6.2f} | {tgt_s}"
        )


if __name__ == "__main__":
    main()

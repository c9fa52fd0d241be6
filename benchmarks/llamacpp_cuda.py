"""llama.cpp's CUDA build on the GGUF file NovaInfer ran (issue 38's GPU baseline): builds llama-bench and
llama-batched-bench from a llama.cpp source tree (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, the build we
compare with on the CPU) for one GPU architecture, then measures what benchmarks/gguf_gpu.py measures for NovaInfer:
- batch-1 decode: llama-bench's tg (a 128-token generation after an empty prompt), every layer on the GPU;
- N concurrent streams: llama-batched-bench with N parallel sequences of a P-token prompt and T new tokens each,
  reported as new tokens over the whole run (prefill included), as gguf_gpu.py's 32-stream figure is.

    python3 benchmarks/llamacpp_cuda.py --src <llama.cpp dir> --model file.gguf [--arch 90] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time


def build(src: str, out: str, arch: str, jobs: int) -> tuple[str, float]:
    """The two tools built under out (reused when there); returns (bin dir, seconds the build took)."""
    bindir = os.path.join(out, "bin")
    if all(os.path.exists(os.path.join(bindir, t)) for t in ("llama-bench", "llama-batched-bench")):
        return bindir, 0.0
    t0 = time.perf_counter()
    flags = [
        "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF",
    ]
    subprocess.run(["cmake", "-S", src, "-B", out, "-G", "Ninja", *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["cmake", "--build", out, "-j", str(jobs), "--target", "llama-bench", "llama-batched-bench"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return bindir, time.perf_counter() - t0


def decode_batch1(bindir: str, model: str, tokens: int, repeat: int) -> dict:
    """llama-bench's generation rate at batch 1 (tok/s, the mean over repeat runs) and its flash-attention setting."""
    out = subprocess.run(
        [f"{bindir}/llama-bench", "-m", model, "-ngl", "99", "-p", "0", "-n", str(tokens), "-r", str(repeat)]
        + ["-o", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    row = json.loads(out)[0]
    return {"decode_tok_s": row["avg_ts"], "decode_stddev": row["stddev_ts"], "flash_attn": row.get("flash_attn")}


def streams(bindir: str, model: str, n: int, prompt: int, new: int) -> dict:
    """llama-batched-bench with n parallel sequences: new tokens over the whole run, and its decode-only rate."""
    ctx = n * (prompt + new) + 256
    out = subprocess.run(
        [f"{bindir}/llama-batched-bench", "-m", model, "-ngl", "99", "-c", str(ctx), "-b", "2048", "-ub", "512"]
        + ["-npp", str(prompt), "-ntg", str(new), "-npl", str(n), "--output-format", "jsonl"],
        check=True,
        capture_output=True,
        text=True,
    )
    row = next(json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{"))
    return {
        "streams_tok_s": row["pl"] * row["tg"] / row["t"],
        "streams_decode_tok_s": row["speed_tg"],
        "streams_flash_attn": row["flash_attn"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="llama.cpp's source tree")
    ap.add_argument("--build", default="/tmp/llama-cuda")
    ap.add_argument("--arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (90: H100 / H200)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-prompt", type=int, default=128)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bindir, build_s = build(args.src, args.build, args.arch, os.cpu_count() or 8)
    res = {"build_s": build_s}
    res |= decode_batch1(bindir, args.model, args.decode_tokens, args.repeat)
    res |= streams(bindir, args.model, args.streams, args.stream_prompt, args.stream_tokens)
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

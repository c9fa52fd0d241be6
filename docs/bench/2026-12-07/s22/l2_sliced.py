"""Lab (session 22): a 4-bit weight dequantized slice by slice into a bf16 scratch that stays in L2, each slice's
product run by cuBLAS right after its dequantization, against today's paths.

Today the INT4 layer from 128 rows (kernels/int4_gemm.py DEQUANT_MIN_M) and the GGUF layer from 2 rows
(kernels/gguf_gemm.py gguf_matmul) dequantize the whole weight into a transient bf16 tensor, then run cuBLAS.
HBM then carries about 4.5 bytes a weight: the codes (~0.5), the bf16 write (2) and cuBLAS's read (2). bf16
itself carries 2. That is why 32 GGUF streams sit at llama.cpp's rate and INT4's bench shape at 0.65x bf16.

Here the weight is cut into slices of S rows, and two scratch buffers of S rows are used in turns, small enough that
L2 (50 MB on an H100 or H200) holds them. Each slice is dequantized into a buffer, and cuBLAS multiplies it at
once: out[:, a:b] = x @ slice^T. If the scratch lines stay in L2, dirty and overwritten by later slices, HBM
carries only the codes. If L2 cannot hold them, this is the whole-weight path again plus launches.

For each 7B layer shape, row count and format (INT4 g128, Q4_K), it prints device times (CUDA graphs, weights cycled
past L2, benchmarks/quant_gpu.py device_us) for bf16 F.linear, the whole-weight path and the sliced path at several
slice sizes, with each result's error against the dequantized float product.

    python docs/bench/2026-12-07/s22/l2_sliced.py                     # a GPU
    TRITON_INTERPRET=1 python docs/bench/2026-12-07/s22/l2_sliced.py --tiny   # the CPU: tiny shapes, checks only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.gguf_gpu import random_weight  # noqa: E402
from benchmarks.quant_gpu import SHAPES_7B, SHAPES_TINY, Operands, device_us, rel  # noqa: E402
from novainfer.kernels import gguf_gemm, int4_gemm  # noqa: E402
from novainfer.layers.quantization.int4 import dequantize_int4  # noqa: E402

GROUP = 128


def int4_rows(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor):
    """dequant(a, b, out): rows a..b of a packed INT4 weight into out [b - a, K]."""
    k = q.shape[1] * 8
    block_k = min(1024, triton.next_power_of_2(k))

    def dequant(a: int, b: int, out: torch.Tensor) -> None:
        grid = (b - a, triton.cdiv(k, block_k))
        int4_gemm._int4_dequant_kernel[grid](q[a:b], s[a:b], z[a:b], out, k, GROUP=GROUP, BLOCK_K=block_k)

    return dequant


def gguf_rows(w: gguf_gemm.GGUFWeight):
    """dequant(a, b, out): rows a..b of a GGUF weight into out [b - a, K]."""

    def dequant(a: int, b: int, out: torch.Tensor) -> None:
        gguf_gemm.gguf_dequantize(w.map(lambda t: t[a:b], b - a), out.dtype, out)

    return dequant


def whole(x: torch.Tensor, n: int, dequant, dense: torch.Tensor) -> torch.Tensor:
    """Today's path: the whole weight dequantized into dense, then one cuBLAS GEMM."""
    dequant(0, n, dense)
    return torch.nn.functional.linear(x, dense)


def sliced(x: torch.Tensor, n: int, dequant, scratch: list[torch.Tensor], rows: int) -> torch.Tensor:
    """Slices of `rows` weight rows, dequantized into the scratch buffers in turns, each multiplied at once."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    for i, a in enumerate(range(0, n, rows)):
        b = min(a + rows, n)
        buf = scratch[i % len(scratch)][: b - a]
        dequant(a, b, buf)
        torch.mm(x, buf.t(), out=out[:, a:b])
    return out


def slice_rows(k: int, mb: float, n: int) -> int:
    """Rows of a bf16 slice of about mb MB (a multiple of 128, at most n)."""
    return max(128, min(n, int(mb * 2**20 / (2 * k)) // 128 * 128))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--slice-mb", type=float, nargs="+", default=[6, 12, 20])
    ap.add_argument("--formats", nargs="+", default=["int4", "Q4_K"])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SHAPES_TINY if args.tiny else SHAPES_7B
    slice_mb = [0.05, 0.1] if args.tiny else args.slice_mb  # tiny: 100 and 128 rows (a ragged last slice)
    g = torch.Generator(device=device).manual_seed(0)
    rng = np.random.default_rng(0)
    start, worst = time.time(), 0.0
    print(
        "| layer | format | rows | bf16 (us) | the package's path (us) | whole (us) | "
        + " | ".join(f"sliced {m} MB" for m in slice_mb)
        + " |"
    )
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        for fmt in args.formats:
            if fmt == "int4":
                copies = [ops.copy("int4", i) for i in range(1 if args.tiny else 8)]
                dequants = [int4_rows(*c) for c in copies]
                packaged = [lambda x, c=c: int4_gemm.int4_linear(x, *c, GROUP) for c in copies]
                wf = dequantize_int4(ops.q4, ops.s4, ops.z4, GROUP).float().t()  # [K, N] -> [N, K]
                qbytes = ops.q4.nbytes + ops.s4.nbytes + ops.z4.nbytes
            else:
                w, _ = random_weight(fmt, n, k, device, rng)
                copies = [w] + [w.map(torch.clone, n) for _ in range(0 if args.tiny else 7)]
                dequants = [gguf_rows(c) for c in copies]
                packaged = [lambda x, c=c: gguf_gemm.gguf_matmul(x, [c]) for c in copies]
                wf = gguf_gemm.dequantize(w).float()
                qbytes = w.nbytes()
            dense = torch.empty((n, k), dtype=dtype, device=device)
            for m in args.rows:
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                ref = x.float() @ wf.t()
                bf16 = device_us(lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w),
                                 2 * n * k, device, args.iters)  # fmt: skip
                err = max(rel(whole(x, n, dequants[0], dense).float(), ref), rel(packaged[0](x).float(), ref))
                t_pkg = device_us(lambda i: lambda: packaged[i % len(packaged)](x), qbytes, device, args.iters)
                t_whole = device_us(lambda i: lambda: whole(x, n, dequants[i % len(dequants)], dense), qbytes, device,
                                    args.iters)  # fmt: skip
                cells = []
                for mb in slice_mb:
                    r = {0.05: 100, 0.1: 128}[mb] if args.tiny else slice_rows(k, mb, n)
                    scratch = [torch.empty((r, k), dtype=dtype, device=device) for _ in range(2)]
                    e = rel(sliced(x, n, dequants[0], scratch, r).float(), ref)
                    worst = max(worst, e, err)
                    us = device_us(lambda i, r=r, s=scratch: lambda: sliced(x, n, dequants[i % len(dequants)], s, r),
                                   qbytes, device, args.iters)  # fmt: skip
                    cells.append(f"{us:8.1f} ({bf16 / us:.2f}x, {r} rows, rel {e:.1e})")
                print(
                    f"| {name} | {fmt} | {m} | {bf16:8.1f} | {t_pkg:8.1f} ({bf16 / t_pkg:.2f}x) | "
                    f"{t_whole:8.1f} ({bf16 / t_whole:.2f}x) | " + " | ".join(cells) + " |",
                    flush=True,
                )
    print(f"worst rel err {worst:.1e} (bound 1e-2); total {time.time() - start:.0f} s")
    assert worst < 1e-2, worst


if __name__ == "__main__":
    main()

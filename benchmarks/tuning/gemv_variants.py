"""Batch-1 GEMV variants for the pre-quantized formats (block FP8, INT4 g128), each over a tile sweep, on Qwen2.5-7B's
layer shapes: which kernel form and tile come closest to HBM bandwidth (the decode step's cost at batch 1).

Variants (the package's GEMVs, kernels/gemv.py for FP8 and kernels/int4_gemm.py for INT4, are "cur"; the others live
here until one wins):
- fp8 cur: kernels/gemv.py with block scales, the form "fp8 flat" won as on 2026-11-27 (the kernel it replaced, x in
  [BLOCK_N, NB, 128] tiles with a reduction a step, ran at 1.24-1.74x bf16 against flat's 1.42-1.93x);
- fp8 flat: [BLOCK_N, BLOCK_K] tiles, the block scale folded into x (one multiply per input, not per weight), a
  [BLOCK_N, BLOCK_K] float32 accumulator reduced once at the end;
- int4 cur: [BLOCK_N, C, 4] words, (code | 2^23 bits) - (2^23 + zero), then an FMA;
- int4 unit: the same tile, each code placed in the top mantissa bits of 1.0 (as_float = 1 + code / 16: a shift and
  one and-or a code, then the FMA), the zero point and the 1s removed per 32-input chunk with sum(x);
- int4 flat: [BLOCK_N, BLOCK_K / 8] words, x loaded once per nibble as a row vector, the unit trick, scales per word.
Each is checked against the dequantized torch product; device time per call in CUDA graphs over weight copies L2
cannot hold.

    python benchmarks/tuning/gemv_variants.py                  # on the GPU: one table
    TRITON_INTERPRET=1 python benchmarks/tuning/gemv_variants.py --tiny
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.quant_gpu import Operands, device_us, rel  # noqa: E402

SHAPES = [("qkv_proj", 3584, 4608), ("o_proj", 3584, 3584), ("gate_up_proj", 3584, 37888), ("down_proj", 18944, 3584)]
SHAPES_TINY = [("qkv_proj", 256, 384), ("down_proj", 512, 256)]


@triton.jit
def _fp8_flat_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    N,
    K,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    s_row = ws_ptr + (pid * BLOCK_N // GROUP_N) * tl.cdiv(K, GROUP_K)
    w_rows = w_ptr + rload[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + kk
        if EVEN_K:
            w = tl.load(w_rows + offs[None, :], eviction_policy="evict_first")
            x = tl.load(x_ptr + offs)
            s = tl.load(s_row + offs // GROUP_K)
        else:
            km = offs < K
            w = tl.load(w_rows + offs[None, :], mask=km[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + offs, mask=km, other=0.0)
            s = tl.load(s_row + offs // GROUP_K, mask=km, other=0.0)
        acc += w.to(tl.float32) * (x.to(tl.float32) * s)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _int4_unit_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)
    chunk = tl.arange(0, C)
    lane = tl.arange(0, 4)
    q_ptrs = q_ptr + rload[:, None, None] * stride_qn + (chunk[:, None] * 4 + lane[None, :])[None, :, :]
    sz_row = rload[:, None] * (K // GROUP)
    x_k = (chunk[:, None] * 32 + lane[None, :])[None, :, :] + 0 * rows[:, None, None]
    x32 = chunk[:, None] * 32 + tl.arange(0, 32)[None, :]
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K a multiple of BLOCK_K here
        grp = sz_row + ((k0 + chunk * 32) // GROUP)[None, :]
        q = tl.load(q_ptrs + k0 // 8, eviction_policy="evict_first")
        s = tl.load(s_ptr + grp).to(tl.float32)
        z = tl.load(z_ptr + grp).to(tl.float32)
        sx = tl.sum(tl.load(x_ptr + k0 + x32).to(tl.float32), 1)  # [C]
        p = tl.zeros([BLOCK_N, C, 4], tl.float32)
        for j in tl.static_range(8):
            if 4 * j <= 19:
                f = ((q << (19 - 4 * j)) & 0x780000) | 0x3F800000
            else:
                f = ((q >> (4 * j - 19)) & 0x780000) | 0x3F800000
            p += tl.load(x_ptr + k0 + 4 * j + x_k).to(tl.float32) * f.to(tl.float32, bitcast=True)
        # sum x (1 + c / 16) = sx + sum c x / 16, so sum (c - z) x = 16 p - (16 + z) sx
        acc += s * (16.0 * tl.sum(p, 2) - (16.0 + z) * sx[None, :])
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _int4_flat_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    W: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)
    i = tl.arange(0, W)
    q_ptrs = q_ptr + rload[:, None] * stride_qn + i[None, :]
    xbase = (i // 4) * 32 + (i % 4)  # the input of nibble 0 of word i; nibble j's is 4 j further
    sz_row = rload[:, None] * (K // GROUP)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = tl.load(q_ptrs + k0 // 8, eviction_policy="evict_first")
        g = sz_row + ((k0 + (i // 4) * 32) // GROUP)[None, :]
        s = tl.load(s_ptr + g).to(tl.float32)
        z = tl.load(z_ptr + g).to(tl.float32)
        p = tl.zeros([BLOCK_N, W], tl.float32)
        sx = tl.zeros([W], tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_ptr + k0 + xbase + 4 * j).to(tl.float32)
            sx += xj
            if 4 * j <= 19:
                f = ((q << (19 - 4 * j)) & 0x780000) | 0x3F800000
            else:
                f = ((q >> (4 * j - 19)) & 0x780000) | 0x3F800000
            p += f.to(tl.float32, bitcast=True) * xj[None, :]
        acc += s * (16.0 * p - (16.0 + z) * sx[None, :])
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=rows < N)


def fp8_cur(x, wq, ws, tiles, stages):
    from novainfer.kernels.gemv import gemv

    return gemv(x, wq, weight_scale=ws, tiles=(*tiles, stages))


def fp8_flat(x, wq, ws, tiles, stages):
    k = x.shape[1]
    n = wq.shape[0]
    bn, bk, warps = tiles
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_flat_kernel[(triton.cdiv(n, bn),)](
        x, wq, ws, out, n, k, GROUP_N=128, GROUP_K=128, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def int4_cur(x, q, s, z, tiles, stages):
    from novainfer.kernels import int4_gemm as i4

    k = x.shape[1]
    n = q.shape[0]
    bn, bk, warps = tiles
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    i4._int4_gemv_kernel[(triton.cdiv(n, bn),)](
        x, q, s, z, out, n, k, q.stride(0), x.stride(0), out.stride(0), M=1, GROUP=128, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=k % bk == 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def int4_new(kernel):
    def run(x, q, s, z, tiles, stages):
        k = x.shape[1]
        n = q.shape[0]
        bn, bk, warps = tiles
        if k % bk:
            return None
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
        kernel[(triton.cdiv(n, bn),)](
            x, q, s, z, out, n, k, q.stride(0), GROUP=128, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        return out

    return run


VARIANTS = {
    "fp8 cur": ("fp8", fp8_cur),
    "fp8 flat": ("fp8", fp8_flat),
    "int4 cur": ("int4", int4_cur),
    "int4 unit": ("int4", int4_new(_int4_unit_kernel)),
    "int4 flat": ("int4", int4_new(_int4_flat_kernel)),
}
TILES = [(1, 1024, 2), (2, 1024, 4), (2, 2048, 4), (4, 512, 2), (4, 512, 4), (4, 1024, 4), (4, 2048, 8),
         (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8)]  # fmt: skip
STAGES = [1, 3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = SHAPES_TINY if args.tiny else SHAPES
    tiles = [(4, 128, 4), (2, 256, 4)] if args.tiny else TILES
    stages = [1] if args.tiny else STAGES
    g = torch.Generator(device=device).manual_seed(0)
    start = time.time()
    best: dict[tuple[str, str], tuple[float, tuple]] = {}
    bf16_us: dict[str, float] = {}
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        x = (torch.randn(1, k, device=device, generator=g)).to(ops.w16.dtype)
        bf16_us[name] = device_us(
            lambda i: lambda: torch.nn.functional.linear(x, ops.copy("bf16", i)[0]), n * k * 2, device, args.iters
        )
        from novainfer.layers.quantization.fp8_block import expand_blocks
        from novainfer.layers.quantization.int4 import dequantize_int4

        ref = {
            "fp8": x.float() @ (ops.wq.float() * expand_blocks(ops.ws, (128, 128), (n, k))).t(),
            "int4": x.float() @ dequantize_int4(ops.q4, ops.s4, ops.z4, 128).float(),
        }
        for (vname, (fmt, fn)), t, st in itertools.product(VARIANTS.items(), tiles, stages):
            if time.time() - start > args.budget_s:
                break
            try:
                y = fn(x, *ops.copy(fmt, 0), t, st)
            except Exception as e:  # a tile the kernel cannot take (too many registers, shape)
                print(f"{name:13s} {vname:10s} {t} s{st}: {type(e).__name__}", flush=True)
                continue
            if y is None:
                continue
            err = rel(y.float(), ref[fmt])
            if err > 2e-2:
                print(f"{name:13s} {vname:10s} {t} s{st}: WRONG rel err {err:.1e}", flush=True)
                continue
            nbytes = n * k if fmt == "fp8" else n * k // 2
            us = device_us(lambda i, fn=fn, fmt=fmt, t=t, st=st: lambda: fn(x, *ops.copy(fmt, i), t, st), nbytes,
                           device, args.iters)  # fmt: skip
            if (name, vname) not in best or us < best[(name, vname)][0]:
                best[(name, vname)] = (us, (t, st, err))
    print(
        f"\n{'layer':13s} {'variant':10s} {'us':>8s} {'x bf16':>7s} {'TB/s':>6s}  best tile (BN, BK, warps), stages, rel err"
    )
    for name, k, n in shapes:
        print(f"{name:13s} {'bf16':10s} {bf16_us[name]:8.1f} {1.0:7.2f} {n * k * 2 / bf16_us[name] / 1e6:6.2f}")
        for vname, (fmt, _) in VARIANTS.items():
            if (name, vname) in best:
                us, (t, st, err) = best[(name, vname)]
                nbytes = n * k if fmt == "fp8" else n * k // 2
                print(
                    f"{name:13s} {vname:10s} {us:8.1f} {bf16_us[name] / us:7.2f} {nbytes / us / 1e6:6.2f}  {t} s{st} {err:.1e}"
                )
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Lab (session 23): INT4 (W4A16, g128) GEMMs for 64-512 rows that keep the weight packed, against the package's
paths (from 128 rows: the whole weight dequantized into bf16, then cuBLAS) and bf16 cuBLAS.

The package's fused GEMM (kernels/int4_gemm.py _int4_gemm_kernel) computes out^T = W x^T and multiplies each K
step's dot by the group scale, acc += dot(W_codes - z, x^T) * s. Compiled for sm_90 (triton.compile, no GPU
needed) its loop shows why it runs far from the tensor cores' rate at 64+ rows: the scaling after the dot makes
every wgmma synchronous (warp_group_dot_wait pendings=0), the dequantized tile takes a round trip through shared
memory to reach the register operand, and x's tile is loaded synchronously. Two variants here:
- folded: the same orientation, the scale folded into the bf16 weight (w = (code - z) * s, the value the dequantized
  path feeds cuBLAS), so the dot accumulates in place: acc = dot(w, x^T, acc) (the package's kernel with
  int4_gemm_folded.patch applied);
- wide: out = x W^T with x's rows on the dot's M side (the usual GEMM for many rows): x's tile is the left operand,
  the dequantized weight the right one, written once into shared memory where wgmma reads it.
Both split K (float32 atomics) only where the output tiles leave SMs idle. And the package's own path with a
dequantization kernel that loads each 32 inputs' scale and zero once (dequant_rows; the package's loads them once per
input), then cuBLAS.

    python docs/bench/2026-12-07/s23/w4_wide.py [--rows 64 128 256 512] [--iters 20]     # a GPU
    TRITON_INTERPRET=1 python docs/bench/2026-12-07/s23/w4_wide.py --tiny                    # the CPU: checks only
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.quant_gpu import SHAPES_7B, SHAPES_TINY, Operands, device_us, rel  # noqa: E402
from novainfer.kernels import int4_gemm  # noqa: E402
from novainfer.kernels.int4_gemm import MAGIC  # noqa: E402
from novainfer.kernels.tiling import even_split, grouped_tile, split_k  # noqa: E402
from novainfer.layers.quantization.int4 import dequantize_int4  # noqa: E402

GROUP = 128


@triton.jit
def _weight_tile(q_ptrs, s_ptr, z_ptr, sz_col, k0, DT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] of (code - zero) * scale in DT (x's dtype): the dequantized weight tile at K step k0."""
    C: tl.constexpr = BLOCK_K // 32
    shifts = (tl.arange(0, 8) * 4)[None, None, :, None]
    q = tl.reshape(tl.load(q_ptrs + k0 // 8), [BLOCK_N, C, 1, 4])
    codes = tl.reshape(((q >> shifts) & 0xF) | MAGIC, [BLOCK_N, BLOCK_K]).to(tl.float32, bitcast=True)
    g = k0 // GROUP
    s = tl.load(s_ptr + sz_col + g).to(tl.float32)
    zoff = tl.load(z_ptr + sz_col + g).to(tl.float32) + 8388608.0
    return ((codes - zoff[:, None]) * s[:, None]).to(DT)


@triton.jit
def _wide_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_qn, stride_xm, stride_om, K_PER_SPLIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mload = tl.minimum(offs_m, M - 1).to(tl.int64)
    nload = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + nload[:, None] * stride_qn + tl.arange(0, BLOCK_K // 8)[None, :]
    x_ptrs = x_ptr + mload[:, None] * stride_xm + offs_k[None, :]
    sz_col = nload * (K // GROUP)
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_ptrs + k0)
        w = _weight_tile(q_ptrs, s_ptr, z_ptr, sz_col, k0, x_ptr.dtype.element_ty, GROUP, BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT > 1:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):  # fmt: skip
    """BLOCK_N rows x BLOCK_K inputs a program (BLOCK_K divides K): each 32 inputs' scale and zero loaded once, not
    once per input as int4_gemm._int4_dequant_kernel does."""
    C: tl.constexpr = BLOCK_K // 32
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    chunk = tl.arange(0, C)
    q = tl.load(q_ptr + rows[:, None, None] * (K // 8) + (k0 // 8 + chunk * 4)[None, :, None] + tl.arange(0, 4))
    grp = rows[:, None] * (K // GROUP) + ((k0 + chunk * 32) // GROUP)[None, :]
    s = tl.load(s_ptr + grp).to(tl.float32)[:, :, None, None]
    zoff = (tl.load(z_ptr + grp).to(tl.float32) + 8388608.0)[:, :, None, None]
    shifts = (tl.arange(0, 8) * 4)[None, None, :, None]
    codes = ((tl.reshape(q, [BLOCK_N, C, 1, 4]) >> shifts) & 0xF) | MAGIC
    w = (codes.to(tl.float32, bitcast=True) - zoff) * s  # [BLOCK_N, C, 8, 4]: input c * 32 + 4 j + w
    offs = rows[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :]
    tl.store(out_ptr + offs, tl.reshape(w, [BLOCK_N, BLOCK_K]).to(out_ptr.dtype.element_ty))


def dequant_rows(q, s, z, dtype, block_n: int = 8, block_k: int = 512) -> torch.Tensor:
    """The packed weight as a dense [N, K] tensor of dtype, by _dequant_rows_kernel."""
    n, k = q.shape[0], q.shape[1] * 8
    while k % block_k:
        block_k //= 2
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    grid = (triton.cdiv(n, block_n), k // block_k)
    _dequant_rows_kernel[grid](q, s, z, out, n, k, GROUP=GROUP, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _folded_module():
    """kernels/int4_gemm.py with int4_gemm_folded.patch applied, imported from a temporary file (no copy kept)."""
    src = os.path.join(ROOT, "novainfer", "kernels", "int4_gemm.py")
    out = os.path.join(tempfile.mkdtemp(), "int4_gemm_folded.py")
    patch = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int4_gemm_folded.patch")
    subprocess.run(["patch", "-s", "-o", out, src, patch], check=True)
    spec = importlib.util.spec_from_file_location("int4_gemm_folded", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KERNELS = {"folded": _folded_module()._int4_gemm_kernel, "wide": _wide_kernel}
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_M being x's rows in both kernels; a row count
    # tries those with BLOCK_M <= max(16, rows)
    (16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3),
    (128, 64, 128, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
]  # fmt: skip


def w4_gemm(kind: str, x, q, s, z, tiles, split=None) -> torch.Tensor:
    """x [M, K] times the packed INT4 weight by the lab kernel `kind` -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    bm, bn, bk, warps, stages = tiles
    bk = min(bk, GROUP)
    tiles_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split is None:
        split, per_split = split_k(k, tiles_mn, bk, x.device, programs_per_sm=1)
    else:
        split, per_split = even_split(k, split, bk)
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if split > 1
        else torch.empty((m, n), dtype=x.dtype, device=x.device)
    )
    KERNELS[kind][(tiles_mn, split)](
        x, q, s, z, out, m, n, k, q.stride(0), x.stride(0), out.stride(0), per_split,
        GROUP=GROUP, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT=split,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out if split == 1 else out.to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes, rows = (SHAPES_TINY, [3, 20]) if args.tiny else (SHAPES_7B, args.rows)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 dot is unreliable
    g = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    head = (
        "| layer | rows | bf16 (us) | package (us) | fused tiles (us) | dequant_rows + cuBLAS | "
        + " | ".join(KERNELS)
        + " |"
    )
    print(head + "\n|" + "---|" * (head.count("|") - 1), flush=True)
    for name, k, n in shapes:
        ops = Operands(k, n, device, g)
        ref = dequantize_int4(ops.q4, ops.s4.float(), ops.z4, GROUP)  # [K, N] float
        nbytes = ops.q4.numel() * 4
        for m in rows:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            want = x.float() @ ref
            if device.type != "cuda":
                got = torch.nn.functional.linear(x, dequant_rows(*ops.copy("int4", 0), x.dtype, 4, 64))
                worst = max(worst, rel(got.float(), want))
                for kind in KERNELS:
                    for split in (1, 2):
                        got = w4_gemm(kind, x, *ops.copy("int4", 0), (16, 32, 32, 4, 1), split)
                        worst = max(worst, rel(got.float(), want))
                continue
            bf16 = device_us(lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w), 2 * n * k,
                             device, args.iters)  # fmt: skip
            pkg = device_us(lambda i: lambda: int4_gemm.int4_linear(x, *ops.copy("int4", i), GROUP), nbytes, device,
                            args.iters)  # fmt: skip
            fused = min(
                device_us(
                    lambda i, t=t: lambda: int4_gemm.int4_gemm(x, *ops.copy("int4", i), GROUP, tiles=t),
                    nbytes,
                    device,
                    args.iters,
                )  # fmt: skip
                for t in {t for c in int4_gemm.GEMM_CANDIDATES.values() for t in c if t[0] <= max(16, m)}
            )
            dq = min(
                device_us(
                    lambda i, t=t: (
                        lambda: torch.nn.functional.linear(x, dequant_rows(*ops.copy("int4", i), x.dtype, *t))
                    ),
                    nbytes,
                    device,
                    args.iters,
                )  # fmt: skip
                for t in ((8, 512), (4, 1024))
            )
            worst = max(worst, rel(torch.nn.functional.linear(x, dequant_rows(*ops.copy("int4", 0), x.dtype)).float(),
                                   want))  # fmt: skip
            cells = [f"{dq:7.1f} ({bf16 / dq:.2f}x)"]
            for kind in KERNELS:
                best = None
                for t in (t for t in TILES if t[0] <= max(16, m)):
                    try:
                        err = rel(w4_gemm(kind, x, *ops.copy("int4", 0), t).float(), want)
                        us = device_us(lambda i, t=t: lambda: w4_gemm(kind, x, *ops.copy("int4", i), t), nbytes,
                                       device, args.iters)  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - a tile this GPU lacks shared memory for
                        print(f"  {kind} {t}: {type(e).__name__}", flush=True)
                        continue
                    worst = max(worst, err)
                    if best is None or us < best[0]:
                        best = (us, t)
                cells.append(f"{best[0]:7.1f} ({bf16 / best[0]:.2f}x, {best[1]})" if best else "-")
            print(f"| {name} | {m} | {bf16:7.1f} | {pkg:7.1f} ({bf16 / pkg:.2f}x) | {fused:7.1f} ({bf16 / fused:.2f}x) | "
                  + " | ".join(cells) + " |", flush=True)  # fmt: skip
    print(f"worst rel err {worst:.1e} (bound 1e-2)")
    assert worst < 1e-2


if __name__ == "__main__":
    main()

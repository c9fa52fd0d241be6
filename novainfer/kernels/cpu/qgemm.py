"""The quantized GEMMs of a PackedWeight and its dequantizer, in C (csrc/qgemm_cpu.c, its many-row form
csrc/qgemm_panel_cpu.c, whose tiles run AVX-512 VNNI where the CPU has it (csrc/qgemm_avx512.c) and, for many
rows, AMX-INT8 (csrc/qgemm_amx.c), picked at run time; csrc/dequantize_cpu.c). Scales and zeros are read in the
weight's scale_format (float32, float16, or the K-quants' int8 multipliers of float16 factors: repack.py). 16-bit float weights (f16, bf16) go to their own GEMM
(csrc/f16gemm_cpu.c: widened exactly, float32 sums, x as it is)."""

from __future__ import annotations

import torch

from novainfer.kernels.cpu.library import library, num_threads
from novainfer.kernels.cpu.repack import PackedWeight

# From this many activation rows on, q4_gemm/q8_gemm run the panel kernel (csrc/qgemm_cpu.c's panel_min_rows; faster
# from about 16 rows on: benchmarks/tuning/qgemm_rows.py --crossover). Both kernels give a row the same bits.
PANEL_MIN_ROWS = 16


def quant_gemm(x: torch.Tensor, w: PackedWeight, panel: bool = False) -> torch.Tensor:
    """x [M, K] float32 contiguous @ dequant(w)^T -> [M, N] float32 (x rounded to int16 per block of 32; f16 and
    bf16 weights: x as it is); panel: the many-row kernel at any row count (by default the library picks it from
    PANEL_MIN_ROWS rows on; f16 and bf16 have one kernel for every M)."""
    lib = library()
    if w.wide:
        return f16_gemm(x, w)
    q4_gemm, q8_gemm = (lib.q4_gemm_panel, lib.q8_gemm_panel) if panel else (lib.q4_gemm, lib.q8_gemm)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    fmt = w.scale_format
    if w.e2m1:
        mxfp4_gemm = lib.mxfp4_gemm_panel if panel else lib.mxfp4_gemm
        rc = mxfp4_gemm(
            x.data_ptr(), m, k, w.qweight.data_ptr(), w.scales.data_ptr(), fmt, n, y.data_ptr(), num_threads()
        )
    elif w.kind == "q6":
        q6_gemm = lib.q6_gemm_panel if panel else lib.q6_gemm
        rc = q6_gemm(x.data_ptr(), m, k, w.qweight.data_ptr(), w.scales.data_ptr(), fmt, n, y.data_ptr(), num_threads())
    elif w.kind == "q4":
        rc = q4_gemm(
            x.data_ptr(),
            m,
            k,
            w.qweight.data_ptr(),
            w.scales.data_ptr(),
            w.zeros.data_ptr(),
            fmt,
            n,
            y.data_ptr(),
            num_threads(),
        )
    else:
        zeros = w.zeros if w.zeros is not None else w.scales  # never read without has_zeros
        rc = q8_gemm(
            x.data_ptr(),
            m,
            k,
            w.qweight.data_ptr(),
            w.group,
            w.scales.data_ptr(),
            zeros.data_ptr(),
            int(w.zeros is not None),
            fmt,
            n,
            y.data_ptr(),
            num_threads(),
        )
    if rc:
        raise MemoryError(f"quantized CPU GEMM: no memory for a [{m}, {k}] activation's scratch")
    return y


def f16_gemm(x: torch.Tensor, w: PackedWeight, reference: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ w^T for an f16 or bf16 weight -> [M, N] float32; reference: the scalar C reference (the
    same bits; tests)."""
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty(m, w.shape[0], dtype=torch.float32)
    bf16 = int(w.kind == "bf16")
    if reference:
        library().f16_gemm_ref(x.data_ptr(), m, k, w.qweight.data_ptr(), bf16, w.shape[0], y.data_ptr())
    else:
        library().f16_gemm(x.data_ptr(), m, k, w.qweight.data_ptr(), bf16, w.shape[0], y.data_ptr(), num_threads())
    return y


def dequantize(w: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows of the weight, in C: all [N, K], or the given row ids (the embedding lookup). In torch,
    PackedWeight.dequantize is the reference."""
    n, k = w.shape
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        lo, hi = (int(v) for v in torch.aminmax(rows)) if rows.numel() else (0, 0)
        if lo < 0 or hi >= n:
            raise IndexError(f"row ids must be in [0, {n}), got {lo}..{hi}")
    if w.wide:  # rows as stored: widening is exact in torch
        return (w.qweight if rows is None else w.qweight[rows]).float()
    count = n if rows is None else rows.numel()
    out = torch.empty(count, k, dtype=torch.float32)
    if count == 0:
        return out
    zeros = None if w.zeros is None else w.zeros.data_ptr()
    library().dequantize(
        w.qweight.data_ptr(),
        w.quant_code,
        w.group,
        w.scales.data_ptr(),
        zeros,
        w.scale_format,
        k,
        None if rows is None else rows.data_ptr(),
        count,
        out.data_ptr(),
        num_threads(),
    )
    return out


def mxfp4_gemm_ref(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The scalar C reference (csrc/mxfp4_ref_cpu.c) of quant_gemm on an MXFP4 weight given as GGUF's
    block_mxfp4 rows (uint8 [N, K/32 * 17]): x [M, K] float32 -> [M, N], the SIMD kernels' bits (tests)."""
    m, k = x.shape
    x, blocks = x.contiguous(), blocks.contiguous()
    y = torch.empty(m, blocks.shape[0], dtype=torch.float32)
    library().mxfp4_gemm_ref(x.data_ptr(), m, k, blocks.data_ptr(), blocks.shape[0], y.data_ptr())
    return y


# ---- test hooks: both kernels, and both tile sets, give every row the same bits; the tests compare them -------
def set_panel_min_rows(rows: int) -> None:
    """Rows from which quant_gemm's default picks the panel kernel (a huge number: never; tests)."""
    if rows < 1:
        raise ValueError(f"panel rows must be >= 1, got {rows}")
    library().set_panel_min_rows(min(rows, 2**31 - 1))


_ISAS = {"auto": -1, "avx2": 0, "avx512": 1, "amx": 2}


def set_gemm_isa(isa: str) -> str:
    """The GEMMs' tiles: "amx" (AMX-INT8 for the many-row kernel, AVX-512 VNNI for the rest), "avx512" (AVX-512
    VNNI), "avx2", or "auto" (the best the CPU runs, the default); a choice the CPU lacks falls back to the best
    below it. Returns the one in use (tests, benchmarks)."""
    if isa not in _ISAS:
        raise ValueError(f"GEMM ISA must be one of {sorted(_ISAS)}, got {isa!r}")
    return ("avx2", "avx512", "amx")[library().set_gemm_isa(_ISAS[isa])]

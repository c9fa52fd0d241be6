"""Builds (once per machine, with the system C compiler) the AVX2 kernels in csrc/ and calls the quantized GEMM.

The library (csrc/qgemm_cpu.c and its many-row form csrc/qgemm_panel_cpu.c, whose tiles run AVX-512 VNNI
where the CPU has it (csrc/qgemm_avx512.c, picked at run time); the dequantizer of
csrc/dequantize_cpu.c; the decode-step ops of csrc/decode_ops_cpu.c, the decode attention of
csrc/decode_attention_cpu.c and the prefill attention of csrc/prefill_attention_cpu.c, whose wrappers are in
cpu_ops.py; the one-call decode step of
csrc/decoder_stack_cpu.c, wrapped by cpu_decoder.py; the load-time repack into panels of
csrc/repack_panels_cpu.c, called by panel_layout.py) is cached under ~/.cache/novainfer keyed by the sources'
and flags' hash. Where no compiler or no AVX2/FMA/F16C is found, available() is False and GGUF weights load
dequantized (one log line says why). The GEMMs and the dequantizer read a PackedWeight's scales and zeros as
float16 or float32 (its scale_f16, passed to C as a flag).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

import torch

from novainfer.config import CACHE_DIR
from novainfer.layers.quantization.gguf_repack import PackedWeight

logger = logging.getLogger(__name__)
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_HEADERS = [os.path.join(_CSRC, name) for name in ("cpu_pool.h", "cpu_kernels.h", "simd_cpu.h", "panel_cpu.h",
                                                   "qgemm_jobs.h")]
_SOURCES = [os.path.join(_CSRC, name) for name in ("qgemm_cpu.c", "qgemm_panel_cpu.c", "qgemm_avx512.c",
                                                   "dequantize_cpu.c",
                                                   "decode_ops_cpu.c", "decode_attention_cpu.c",
                                                   "prefill_attention_cpu.c", "cpu_pool.c", "decoder_stack_cpu.c",
                                                   "repack_panels_cpu.c", "gated_delta_cpu.c")]
# From this many activation rows on, q4_gemm/q8_gemm run the panel kernel (faster from about 16 rows on:
# benchmarks/qgemm_rows.py --step). Both kernels give a row the same bits, so the switch does not change results.
PANEL_MIN_ROWS = 16
_P = ctypes.c_void_p
_I = ctypes.c_int
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-shared", "-fPIC"]


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        logger.info("quantized CPU kernels need AVX2, FMA and F16C; GGUF weights load dequantized")
        return None
    return build_library(_SOURCES, _HEADERS)


def build_library(sources: list[str], headers: list[str]) -> ctypes.CDLL | None:
    """Compiles C sources (once; cached by their hash) into a library with the kernels' signatures bound; None
    when no compiler is found or the build fails. benchmarks/qgemm_rows.py builds an older commit's with it."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.info("no C compiler (gcc) found for the quantized CPU kernels; GGUF weights load dequantized")
        return None
    sha = hashlib.sha256(" ".join(_CFLAGS).encode())
    for source in [*sources, *headers]:
        with open(source, "rb") as f:
            sha.update(f.read())
    digest = sha.hexdigest()[:16]
    cache = CACHE_DIR
    target = os.path.join(cache, f"qgemm_cpu-{digest}.so")
    if not os.path.exists(target):
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, *_CFLAGS, "-o", tmp, *sources, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            os.unlink(tmp)
            logger.warning("building the quantized CPU kernels failed (%s); GGUF weights load dequantized",
                           proc.stderr.strip()[-300:])
            return None
        os.replace(tmp, target)  # atomic: concurrent builders each write their own temporary file
    lib = ctypes.CDLL(target)
    # an older commit's build (benchmarks) lacks the scale_f16 argument and reads float32 scales only
    lib.scale_f16 = hasattr(lib, "packed_scales_f16")
    f16 = [_I] if lib.scale_f16 else []
    lib.q4_gemm.argtypes = [_P, _I, _I, _P, _P, _P, *f16, _I, _P, _I]
    lib.q8_gemm.argtypes = [_P, _I, _I, _P, _I, _P, _P, _I, *f16, _I, _P, _I]
    if hasattr(lib, "q4_gemm_panel"):  # absent from an older commit's build (benchmarks)
        lib.q4_gemm_panel.argtypes = lib.q4_gemm.argtypes
        lib.q8_gemm_panel.argtypes = lib.q8_gemm.argtypes
        lib.set_panel_min_rows.argtypes = [_I]
        lib.set_panel_min_rows(PANEL_MIN_ROWS)
    if hasattr(lib, "set_gemm_isa"):
        lib.set_gemm_isa.argtypes = [_I]
        lib.set_gemm_isa.restype = _I
    _F = ctypes.c_float
    # an older commit's build reads weights in the row layout (benchmarks pass it PackedWeight.rows())
    lib.panel_layout = hasattr(lib, "weights_in_panels")
    if lib.panel_layout:
        lib.dequantize.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _I, _P, _I]
    if hasattr(lib, "repack_panels"):
        lib.repack_panels.argtypes = [_P, _I, _I, _I, _P, _I]
        lib.repack_panels.restype = None
    # the last int: threads (an older build's ops ignore it)
    lib.add_rms_norm.argtypes = [_P, _P, _P, _P, _F, _P, _I, _I, _I]
    lib.silu_and_mul.argtypes = [_P, _P, _I, _I, _I]
    lib.rotary_neox.argtypes = [_P, _I, _I, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I]
    # the last two: the cache's size and where an index is bad (bounds checks; an older build ignores them and
    # its store returns nothing)
    lib.store_kv_bf16.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int64, _P]
    lib.store_kv_bf16.restype = _I if hasattr(lib, "check_kv_slots") else None
    lib.decode_attention_bf16.argtypes = [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _F, _P, _I, _I, _P]
    if hasattr(lib, "prefill_attention_bf16"):
        lib.prefill_attention_bf16.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _F, _P, _I,
                                               _I, _I, _P]  # the last three: tokens, blocks, where (as above)
    return lib


def library() -> ctypes.CDLL:
    """The built library (callers check available() first)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the quantized CPU kernels are not available on this machine")
    return lib


_kernel_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads for these kernels (None: follow torch.get_num_threads()). Their pool never waits for a
    worker that has not started, so a process may give them every core even where torch keeps one free."""
    global _kernel_threads
    if n is not None and n < 1:
        raise ValueError(f"kernel threads must be >= 1, got {n}")
    _kernel_threads = n


def num_threads() -> int:
    """Threads the kernels use now."""
    return _kernel_threads or torch.get_num_threads()


def set_panel_min_rows(rows: int) -> None:
    """Rows from which the GEMM entry points run the panel kernel (a huge number: never; benchmarks' A/B)."""
    if rows < 1:
        raise ValueError(f"panel rows must be >= 1, got {rows}")
    library().set_panel_min_rows(min(rows, 2**31 - 1))


_ISAS = {"auto": -1, "avx2": 0, "avx512": 1}


def set_gemm_isa(isa: str, lib: ctypes.CDLL | None = None) -> str:
    """The quantized GEMMs' tiles: "avx512" (AVX-512 VNNI: taken only where the CPU has it), "avx2", or "auto"
    (the best the CPU runs, the default); returns the one in use. Both give every row the same bits (tests, A/B)."""
    if isa not in _ISAS:
        raise ValueError(f"GEMM ISA must be one of {sorted(_ISAS)}, got {isa!r}")
    return "avx512" if (lib or library()).set_gemm_isa(_ISAS[isa]) else "avx2"


def available() -> bool:
    """True when the kernels can run on this machine (building them on first call)."""
    return _library() is not None


def quant_gemm(x: torch.Tensor, w: PackedWeight, lib: ctypes.CDLL | None = None, panel: bool = False) -> torch.Tensor:
    """x [M, K] float32 contiguous @ dequant(w)^T -> [M, N] float32 (x rounded to int16 per block of 32); lib:
    another build of the kernels (benchmarks), else this one; panel: the many-row kernel of csrc/qgemm_panel_cpu.c
    at any row count (by default the library picks it from PANEL_MIN_ROWS rows on)."""
    lib = lib or _library()
    q4_gemm, q8_gemm = (lib.q4_gemm_panel, lib.q8_gemm_panel) if panel else (lib.q4_gemm, lib.q8_gemm)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    threads = _kernel_threads or torch.get_num_threads()
    f16 = _scale_flag(lib, w)
    if w.kind == "q4":
        rc = q4_gemm(x.data_ptr(), m, k, w.qweight.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), *f16, n,
                     y.data_ptr(), threads)
    else:
        zeros = w.zeros if w.zeros is not None else w.scales  # never read without has_zeros
        rc = q8_gemm(x.data_ptr(), m, k, w.qweight.data_ptr(), w.group, w.scales.data_ptr(), zeros.data_ptr(),
                     int(w.zeros is not None), *f16, n, y.data_ptr(), threads)
    if rc:
        raise MemoryError(f"quantized CPU GEMM: no memory for a [{m}, {k}] activation's scratch")
    return y


def _scale_flag(lib: ctypes.CDLL, w: PackedWeight) -> list[int]:
    """The scale_f16 argument for lib's entry points: [flag], or [] for an older build (float32 scales only)."""
    if lib.scale_f16:
        return [int(w.scale_f16)]
    if w.scale_f16:
        raise ValueError("this build of the CPU kernels reads float32 scales only: pass w.float32_scales()")
    return []


def dequantize(w: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows of the weight, in C: all [N, K], or the given row ids (the embedding lookup). In torch,
    PackedWeight.dequantize is the reference."""
    n, k = w.shape
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        lo, hi = (int(v) for v in torch.aminmax(rows)) if rows.numel() else (0, 0)
        if lo < 0 or hi >= n:
            raise IndexError(f"row ids must be in [0, {n}), got {lo}..{hi}")
    count = n if rows is None else rows.numel()
    out = torch.empty(count, k, dtype=torch.float32)
    if count == 0:
        return out
    zeros = None if w.zeros is None else w.zeros.data_ptr()
    _library().dequantize(w.qweight.data_ptr(), int(w.kind == "q4"), w.group, w.scales.data_ptr(), zeros,
                          int(w.scale_f16), k, None if rows is None else rows.data_ptr(), count, out.data_ptr(),
                          _kernel_threads or torch.get_num_threads())
    return out

"""Builds the C kernels of csrc/ once per machine (cached under platform.CACHE_DIR by the sources' and flags' hash)
and loads them with their signatures bound; their thread count. Where no compiler or no AVX2/FMA/F16C is found,
available() is False and GGUF weights load dequantized (one log line says why)."""

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

from novainfer.platform import CACHE_DIR, cpu_flags

logger = logging.getLogger(__name__)
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_HEADERS = ["cpu_pool.h", "cpu_kernels.h", "simd_cpu.h", "panel_cpu.h", "qgemm_jobs.h", "stack_cpu.h", "f16gemm.h"]
_SOURCES = [
    "qgemm_cpu.c",
    "qgemm_panel_cpu.c",
    "quantize_rows_cpu.c",
    "qgemm_avx512.c",
    "qgemm_amx.c",
    "dequantize_cpu.c",
    "decode_ops_cpu.c",
    "decode_attention_cpu.c",
    "prefill_attention_cpu.c",
    "cpu_pool.c",
    "decoder_stack_cpu.c",
    "gemma4_stack_cpu.c",
    "gdn_layer_cpu.c",
    "gated_attn_layer_cpu.c",
    "hybrid_stack_cpu.c",
    "repack_panels_cpu.c",
    "gated_delta_cpu.c",
    "gated_delta_prefill_cpu.c",
    "mxfp4_ref_cpu.c",
    "f16gemm_cpu.c",
    "f16gemm_avx512.c",
]
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        logger.info("quantized CPU kernels need AVX2, FMA and F16C; GGUF weights load dequantized")
        return None
    path = _build([os.path.join(_CSRC, name) for name in _SOURCES + _HEADERS])
    return None if path is None else _bind(ctypes.CDLL(path))


def _build(files: list[str]) -> str | None:
    """The shared library of the .c files among files (compiled once; cached by every file's hash), or None when
    no compiler is found or the build fails."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.info("no C compiler (gcc) found for the quantized CPU kernels; GGUF weights load dequantized")
        return None
    sha = hashlib.sha256(" ".join(_CFLAGS).encode())
    for source in files:
        with open(source, "rb") as f:
            sha.update(f.read())
    target = os.path.join(CACHE_DIR, f"qgemm_cpu-{sha.hexdigest()[:16]}.so")
    if not os.path.exists(target):
        # a warning, so the command line (which shows warnings only) says why its first seconds are silent
        logger.warning("compiling the CPU kernels (first run only; cached in %s)", CACHE_DIR)
        os.makedirs(CACHE_DIR, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=CACHE_DIR)
        os.close(fd)
        cmd = [cc, *_CFLAGS, "-o", tmp, *[f for f in files if f.endswith(".c")], "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            os.unlink(tmp)
            logger.warning(
                "building the quantized CPU kernels failed (%s); GGUF weights load dequantized",
                proc.stderr.strip()[-300:],
            )
            return None
        os.replace(tmp, target)  # atomic: concurrent builders each write their own temporary file
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The entry points' argument types (csrc/cpu_kernels.h); the last int of most: threads."""
    lib.q4_gemm.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I, _P, _I]
    lib.q8_gemm.argtypes = [_P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _P, _I]
    lib.q4_gemm_panel.argtypes = lib.q4_gemm.argtypes
    lib.q8_gemm_panel.argtypes = lib.q8_gemm.argtypes
    lib.mxfp4_gemm.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _I]
    lib.mxfp4_gemm_panel.argtypes = lib.mxfp4_gemm.argtypes
    lib.q6_gemm.argtypes = lib.q6_gemm_panel.argtypes = lib.mxfp4_gemm.argtypes
    lib.mxfp4_gemm_ref.argtypes = [_P, _I, _I, _P, _I, _P]
    lib.mxfp4_gemm_ref.restype = None
    lib.f16_gemm.argtypes = [_P, _I, _I, _P, _I, _I, _P, _I]
    lib.f16_gemm_ref.argtypes = [_P, _I, _I, _P, _I, _I, _P]
    lib.f16_gemm_ref.restype = None
    lib.set_panel_min_rows.argtypes = [_I]
    lib.set_gemm_isa.argtypes = [_I]
    lib.set_gemm_isa.restype = _I
    lib.dequantize.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _I, _P, _I]
    lib.repack_panels.argtypes = [_P, _I, _I, _I, _P, _I]
    lib.repack_panels.restype = None
    lib.add_rms_norm.argtypes = [_P, _P, _P, _P, _F, _P, _I, _I, _I]
    lib.silu_and_mul.argtypes = [_P, _P, _I, _I, _I]
    lib.rms_norm_add.argtypes = [_P, _I, _P, _F, _P, _P, _I, _I, _I]
    lib.rms_norm_add.restype = None
    lib.gelu_tanh_mul.argtypes = [_P, _I, _P, _I, _P, _I, _I, _I]
    lib.gelu_tanh_mul.restype = None
    lib.rotary_neox.argtypes = [_P, _I, _I, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I]
    # the last two of the KV ops: the cache's size and where an index is bad (bounds checks)
    lib.store_kv_bf16.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int64, _P]
    lib.store_kv_bf16.restype = _I
    lib.decode_attention_bf16.argtypes = [
        _P,
        _I,
        _P,
        _P,
        _P,
        _I,
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _F,
        _I,
        _F,
        _P,
        _P,
        _I,
        _I,
        _P,
    ]
    lib.prefill_attention_bf16.argtypes = [
        _P,
        _I,
        _P,
        _P,
        _P,
        _I,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _F,
        _I,
        _F,
        _P,
        _P,
        _I,
        _I,
        _I,
        _P,
    ]  # sinks (NULL: none), out, threads; the last three: tokens, blocks, where (as above)
    lib.decoder_stack_workspace.argtypes = [_P, _I, _I, _I]
    lib.decoder_stack_workspace.restype = ctypes.c_size_t
    lib.decoder_stack_decode.argtypes = [_P, _I, _P, _F, _P, _P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _P]
    lib.gemma4_stack_workspace.argtypes = [_P, _I, _I, _I]
    lib.gemma4_stack_workspace.restype = ctypes.c_size_t
    lib.gemma4_stack_decode.argtypes = [_P, _I, _P, _F, _P, _P, _P, _I, _I, _P, _P, _P, _I, _P]
    return lib


def library() -> ctypes.CDLL:
    """The built library (callers check available() first)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the quantized CPU kernels are not available on this machine")
    return lib


def available() -> bool:
    """True when the kernels can run on this machine (building them on first call)."""
    return _library() is not None


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

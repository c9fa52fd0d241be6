"""Builds (once per machine, with the system C compiler) and calls the AVX2 quantized GEMM in csrc/.

The library is cached under ~/.cache/novainfer keyed by the source's hash. Where no compiler or no
AVX2/FMA is found, available() is False and GGUF weights load dequantized (one log line says why).
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

from novainfer.layers.quantization.gguf_repack import PackedWeight

logger = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "qgemm_cpu.c")
_P = ctypes.c_void_p
_I = ctypes.c_int


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
    if not {"avx2", "fma"} <= cpu_flags():
        logger.info("quantized CPU kernels need AVX2 and FMA; GGUF weights load dequantized")
        return None
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.info("no C compiler (gcc) found for the quantized CPU kernels; GGUF weights load dequantized")
        return None
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.path.join(os.path.expanduser("~"), ".cache", "novainfer")
    target = os.path.join(cache, f"qgemm_cpu-{digest}.so")
    if not os.path.exists(target):
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-o", tmp, _SOURCE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            os.unlink(tmp)
            logger.warning("building the quantized CPU kernels failed (%s); GGUF weights load dequantized",
                           proc.stderr.strip()[-300:])
            return None
        os.replace(tmp, target)  # atomic: concurrent builders each write their own temporary file
    lib = ctypes.CDLL(target)
    lib.q4_gemm.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I]
    lib.q8_gemm.argtypes = [_P, _I, _I, _P, _I, _P, _P, _I, _I, _P, _P, _I]
    return lib


def available() -> bool:
    """True when the kernels can run on this machine (building them on first call)."""
    return _library() is not None


def quant_gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] float32 contiguous @ dequant(w)^T -> [M, N] float32."""
    lib = _library()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    xsum = torch.empty(m * (k // w.group), dtype=torch.float32)
    threads = torch.get_num_threads()
    if w.kind == "q4":
        lib.q4_gemm(x.data_ptr(), m, k, w.qweight.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), n,
                    y.data_ptr(), xsum.data_ptr(), threads)
    else:
        zeros = w.zeros if w.zeros is not None else w.scales  # never read without has_zeros
        lib.q8_gemm(x.data_ptr(), m, k, w.qweight.data_ptr(), w.group, w.scales.data_ptr(), zeros.data_ptr(),
                    int(w.zeros is not None), n, y.data_ptr(), xsum.data_ptr(), threads)
    return y

"""What this machine offers: a CUDA build of torch and its driver, the CPU's flags (AVX2, AVX-512, BF16, VNNI, AMX)
and the default CPU dtype they imply, where built files are cached. Imports nothing of the package, nor torch."""

from __future__ import annotations

import importlib.util
import os
import re
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Files the engine builds once and reuses across runs: the CPU kernels' shared library (keyed by its sources'
# hash) and tokenizers converted from GGUF files (keyed by the file and the transformers version).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "novainfer")


def torch_has_cuda_build() -> bool:
    """torch/version.py's `cuda` is set (read as text: importing torch is what this avoids)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return True  # unknown: say yes (the core is then spawned, which works on every device)
    values = re.findall(r"^cuda\s*(?::[^=]*)?=\s*(.+?)\s*$", text, re.M)
    return any(v != "None" for v in values)


def cuda_driver_loads() -> bool:
    """The CUDA driver library can be loaded (no GPU is touched)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


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


def default_cpu_dtype() -> torch.dtype:
    """A dense CPU model's dtype when none was asked for: bfloat16 where the CPU multiplies it natively
    (AVX512-BF16 or AMX), float32 elsewhere (a quantization config's activation_dtype comes first)."""
    import torch

    return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32

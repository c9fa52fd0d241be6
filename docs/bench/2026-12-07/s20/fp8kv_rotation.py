"""Lab: would a Hadamard rotation of K and V along head_dim bring the fp8 KV cache's accuracy to issue 38's 99%?

Runs benchmarks/kv_cache_accuracy.py (the default model, SmolLM2-135M, teacher-forced on the docs' text, CPU) with
a float32 cache whose stored K and/or V are replaced by their e4m3 round trip: x -> fp8(x H / s) * s H^T with H the
orthonormal Hadamard matrix (form "rot") or the identity (form "plain", the engine's fp8 cache simulated). Rotating
q and k alike leaves q.k unchanged, and V's rotation is undone on the output, so "rot" is what a rotated fp8 cache
would give.

    PYTHONPATH=. python docs/bench/2026-12-07/s20/fp8kv_rotation.py plain|rot k|v|kv
"""

import math
import sys

import torch

import novainfer
import novainfer.attention.torch_backend as tb
from novainfer.kernels.kv_fp8 import to_fp8

FORM, QUANT = sys.argv.pop(1), sys.argv.pop(1)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    h = hadamard(x.shape[-1]) if FORM == "rot" else torch.eye(x.shape[-1])
    return ((to_fp8(x.float() @ h, scale).float() * scale) @ h.T).to(x.dtype)


store = tb.store_kv


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    if store_kv.active:
        key = round_trip(key, k_scale) if "k" in QUANT else key
        value = round_trip(value, v_scale) if "v" in QUANT else value
    return store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


store_kv.active = False
tb.store_kv = store_kv
engine_llm, runs = novainfer.LLM, [0]


def llm(*args, **kwargs):
    """The script's second engine (its "fp8" run) is the float32 cache with the simulated round trip."""
    runs[0] += 1
    store_kv.active = runs[0] == 2
    return engine_llm(*args, **{**kwargs, "kv_cache_dtype": "float32"})


novainfer.LLM = llm
import benchmarks.kv_cache_accuracy as kca  # noqa: E402

kca.main()

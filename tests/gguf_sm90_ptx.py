"""Compile the GGUF GEMV/GEMM kernels (kernels/gguf_gemm.py) of every type for an H100/H200 (sm_90) on a machine
without a GPU; print their PTX as one JSON line (tests/test_gguf_gpu.py checks it). Ints and pointers are specialized
as aligned to 16, as the launchers' are for a 7B's layers. Run without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from novainfer.kernels import gguf_gemm  # noqa: E402

ALIGNED = {"N", "K", "stride_qn", "stride_hn", "stride_qw", "stride_hw", "stride_xm", "stride_om", "K_PER_SPLIT"}


def sm90_ptx(fn, types: dict[str, str], constexprs: dict, warps: int, stages: int) -> str:
    """fn compiled for sm_90 with these pointer types (other arguments i32; constexprs: their values)."""
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t[0] == "*" or n in ALIGNED}
    options = {"num_warps": warps, "num_stages": stages}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


out = {}
for qtype, f in gguf_gemm.FORMATS.items():
    consts = gguf_gemm._consts(gguf_gemm.GGUFWeight(qtype, *[None] * len(gguf_gemm.ARRAYS), (0, 0)))
    types = {"x_ptr": "*bf16", "q_ptr": "*u8" if f.q4 else "*i8", "d_ptr": "*fp16", "dm_ptr": "*fp16"}
    types |= {"sc_ptr": "*i8" if f.half else "*u8", "mn_ptr": "*u8", "h_ptr": "*u8", "out_ptr": "*bf16"}
    # the batch-1 decode form: int32 words of quants against int8 x (dp4a)
    q8 = {k: v for k, v in consts.items() if k not in ("W", "NB")} | dict(BLOCK_N=8, BLOCK_K=512, ASM=True)
    q8_types = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "q_ptr": "*i32", "h_ptr": "*i32"}
    out[f"{qtype}_gemv"] = sm90_ptx(gguf_gemm._gguf_gemv_q8_kernel, types | q8_types, q8, 4, 1)
    gemm = dict(consts, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT=2)
    out[f"{qtype}_gemm_split"] = sm90_ptx(gguf_gemm._gguf_gemm_kernel, types | {"out_ptr": "*fp32"}, gemm, 8, 3)
print(json.dumps(out))

"""Compile the quantized GEMV/GEMM kernels for an H100/H200 (sm_90) on a machine without a GPU; print their PTX as
one JSON line (tests/test_quant_formats.py checks it). Ints and pointers are specialized as aligned to 16, as the
launchers' are for the real layer shapes. Run without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from novainfer.kernels import fp8_block, gemv, int4_gemm  # noqa: E402

ALIGNED = {"N", "K", "stride_qn", "stride_xm", "stride_om", "stride_am", "stride_cm", "K_PER_SPLIT", "KB_PER_SPLIT"}
ALIGNED |= {"stride_qe", "stride_se", "stride_sn"}  # the MoE kernels' per-expert strides


def ptx(fn, types: dict[str, str], constexprs: dict, warps: int, stages: int) -> str:
    """fn compiled for sm_90 with these argument types (names not given: i32; constexprs: their values)."""
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t[0] == "*" or n in ALIGNED}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    ).asm["ptx"]


INT4 = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": "*bf16"}
FP8 = {
    "x_ptr": "*bf16",
    "res_ptr": "*bf16",
    "norm_w_ptr": "*bf16",
    "w_ptr": "*fp8e4nv",
    "scale_ptr": "*fp32",
    "bias_ptr": "*bf16",
    "out_ptr": "*bf16",
    "res_out_ptr": "*bf16",
}
if __name__ == "__main__":
    out = {
        "int4_gemv": ptx(
            int4_gemm._int4_gemv_kernel,
            INT4,
            {"M": 1, "GROUP": 128, "BLOCK_N": 8, "BLOCK_K": 1024, "EVEN_K": False},
            4,
            1,
        ),
        "fp8_gemv": ptx(
            gemv._gemv_kernel,
            FP8,
            {
                "NORM": True,
                "HAS_RESIDUAL": True,
                "HAS_BIAS": False,
                "SILU_MUL": True,
                "HAS_SCALE": True,
                "GROUP_N": 128,
                "GROUP_K": 128,
                "BLOCK_N": 4,
                "BLOCK_K": 1024,
            },
            4,
            1,
        ),
        "int4_gemm_split": ptx(
            int4_gemm._int4_gemm_kernel,
            INT4 | {"out_ptr": "*fp32"},
            {"GROUP": 128, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT": 2},
            4,
            3,
        ),
        "fp8_gemm_split": ptx(
            fp8_block._block_gemm_kernel,
            {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*fp32"},
            {"A_FP8": True, "EVEN_K": True, "GROUP_N": 128, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}
            | {"GROUP_M": 8, "SPLIT_K": True},
            4,
            3,
        ),
    }
    print(json.dumps(out))

"""Compile the pre-quantized fused-MoE kernels (kernels/fused_moe_quant.py, kernels/fused_moe_gguf.py's grouped
GEMM of Q4_K_M's two types, kernels/moe_gemv.py's INT4 GEMV) for an H100/H200 (sm_90) on a machine without a GPU;
print their PTX as one JSON line (tests/test_moe_prequantized.py checks it). Run without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from novainfer.kernels import fused_moe_gguf, fused_moe_quant, gguf_gemm, moe_gemv  # noqa: E402
from tests.sm90_ptx import ptx  # noqa: E402

ROUTING = {"c_ptr": "*bf16", "topk_weights_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
ROUTING |= {"num_padded_ptr": "*i32"}
TILES = {"A_ROW_DIV": 1, "MUL_ROUTED_WEIGHT": True, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "PRECISION": "tf32"}
FP8 = ROUTING | {"a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32"}
out = {
    "fp8_moe_weight_only": ptx(
        fused_moe_quant._fp8_block_moe_kernel,
        FP8 | {"a_ptr": "*bf16"},
        TILES | {"A_QUANTIZED": False, "BN_S": 128, "BK_S": 128},
        4,
        3,
    ),
    "fp8_moe_quantized": ptx(
        fused_moe_quant._fp8_block_moe_kernel,
        FP8 | {"a_ptr": "*fp8e4nv"},
        TILES | {"A_QUANTIZED": True, "BN_S": 128, "BK_S": 128, "BLOCK_K": 128},
        4,
        3,
    ),
    "int4_moe": ptx(
        fused_moe_quant._int4_moe_kernel,
        ROUTING | {"a_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"},
        TILES | {"GROUP": 128},
        4,
        3,
    ),
}
for qtype in ("Q4_K", "Q6_K"):  # the GGUF experts: a tile dequantized in registers, the dot's register operand
    half = gguf_gemm.FORMATS[qtype].half
    gguf = {"a_ptr": "*bf16", "q_ptr": "*u8", "d_ptr": "*fp16", "dm_ptr": "*fp16", "mn_ptr": "*u8", "h_ptr": "*u8"}
    consts = gguf_gemm._consts(gguf_gemm.GGUFWeight(qtype, *[None] * len(gguf_gemm.ARRAYS), (0, 0)))
    out[f"gguf_moe_{qtype}"] = ptx(
        fused_moe_gguf._gguf_moe_kernel, ROUTING | gguf | {"sc_ptr": "*i8" if half else "*u8"}, TILES | consts, 4, 3
    )
block_n, block_k, warps = moe_gemv.INT4_TILES
out["int4_moe_gemv"] = ptx(
    moe_gemv._int4_moe_gemv_kernel,
    {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "ids_ptr": "*i32", "rw_ptr": "*bf16"}
    | {"out_ptr": "*bf16"},
    {"A_ROW_DIV": 1, "MUL_ROUTED_WEIGHT": True, "GROUP": 128, "BLOCK_N": block_n, "BLOCK_K": block_k},
    warps,
    1,
)
print(json.dumps(out))

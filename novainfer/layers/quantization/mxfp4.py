"""MXFP4 mixture-of-experts weights kept in four bits (gpt-oss's `quantization_config: {quant_method: mxfp4}`).

The checkpoint stacks each layer's experts: gate_up_proj_blocks uint8 [E, 2I, H/32, 16] (two e2m1 codes a byte,
element 2j the low nibble of byte j), gate_up_proj_scales uint8 [E, 2I, H/32] (e8m0: 2^(s - 127) per 32 weights),
down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32]; a weight is e2m1(code) * 2^(s - 127), as
transformers' convert_moe_packed_tensors dequantizes it. gate_up's output rows interleave gate (even rows) and
up (odd); loading puts them in the layer's [gate; up] order (this rank's slice of each).

The blocks and scales are kept as loaded: on CUDA the Triton kernel (kernels/fused_moe_mxfp4.py) reads them;
on the CPU each expert is repacked once into the C kernels' e2m1 q4 panels (kernels/cpu/repack.py: 4.5 bits a
weight) and multiplied by them (kernels/cpu/qgemm.py), where those kernels build; else the experts a step routes
to are dequantized in torch. Only the experts are quantized: every other layer stays dense.
Expert biases, where the model's FusedMoE has them, are layer.w13_bias [E, 2 * local inter] ([gate; up]) and
layer.w2_bias [E, hidden]; each is added before the routing weight (transformers' GptOssExperts).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from torch import nn

from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.quantization.base import FusedMoEMethodBase, QuantizationConfig

logger = logging.getLogger(__name__)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
KNOWN_FIELDS = frozenset({"quant_method", "modules_to_not_convert"})
DENSE_MODULES = ("self_attn", "router", "embed_tokens", "lm_head")  # what the method leaves dense


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch reference: blocks uint8 [..., N, K/32, 16] (or [..., N, K/2]) and scales [..., N, K/32] ->
    the weight [..., N, K] in dtype (exact in float32; rounded once in bfloat16)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(*scales.shape, 32).long()
    w = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return w.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., N, K] -> MXFP4 blocks uint8 [..., N, K/32, 16] and scales [..., N, K/32] (dequantize_mxfp4's
    inverse up to rounding): per 32 weights the scale 2^(floor(log2 amax) - 2), each weight its nearest e2m1 value,
    the first of a tie (llama.cpp's quantizer's choices, so its bytes); writes MXFP4 checkpoints of float weights."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    b = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = b.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).to(torch.int32)
    candidates = torch.ldexp(lut, (e - 127)[..., None, None])  # [..., K/32, 1, 16]
    codes = (candidates - b[..., None]).abs().argmin(-1).to(torch.uint8)  # [..., K/32, 32]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), e.to(torch.uint8)


class Mxfp4MoEMethod(FusedMoEMethodBase):
    """A FusedMoE layer's experts as MXFP4 blocks and scales (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        for name, size in (
            ("hidden_size", hidden_size),
            ("moe intermediate_size per tensor-parallel rank", intermediate_size),
        ):
            if size % 32:
                raise ValueError(f"MXFP4 experts need {name} divisible by 32 (blocks of 32 weights), got {size}")
        shapes = {
            "w13": (num_experts, 2 * intermediate_size, hidden_size // 32),
            "w2": (num_experts, hidden_size, intermediate_size // 32),
        }
        for prefix, shape in shapes.items():
            for suffix, full in (("blocks", (*shape, 16)), ("scales", shape)):
                param = nn.Parameter(torch.empty(full, dtype=torch.uint8), requires_grad=False)
                param.weight_loader = partial(self.weight_loader, layer, prefix)
                param.draw_dummy = partial(_draw_blocks if suffix == "blocks" else _draw_scales, param)
                layer.register_parameter(f"{prefix}_{suffix}", param)
        layer.mxfp4_packed = None  # the CPU's per-expert PackedWeights (w13, w2), once repacked

    def weight_loader(
        self, layer: nn.Module, prefix: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """One checkpoint tensor for all experts: blocks [E, N, K/32, 16] or scales [E, N, K/32], any dtype that
        holds the bytes exactly (the loader may cast them to the model's). shard_id None: as transformers stores
        it (gate_up interleaved); "w1" / "w3": the gate or up rows alone (GGUF's ffn_gate_exps / ffn_up_exps)."""
        data = _as_bytes(loaded, param.data.shape[0])
        rank, size, inter = layer.tp_rank, layer.tp_size, param.data.shape[1] // 2
        if prefix == "w2":
            if shard_id is not None:
                raise ValueError(f"MXFP4 down_proj takes the stacked tensor (shard_id None), got {shard_id!r}")
            if data.shape[2] % size:
                raise ValueError(
                    f"MXFP4 down_proj has {data.shape[2]} blocks of 32 a row, not divisible by tp_size={size}"
                )
            chunk = data.shape[2] // size
            param.data.copy_(_checked(data.narrow(2, rank * chunk, chunk), param.data.shape))
            return
        parts = {"w1": data[:, 0::2], "w3": data[:, 1::2]} if shard_id is None else {shard_id: data}
        for kind, rows in parts.items():
            if kind not in ("w1", "w3"):
                raise ValueError(f"MXFP4 gate_up shard_id must be None, 'w1' or 'w3', got {kind!r}")
            if rows.shape[1] != inter * size:
                raise ValueError(f"MXFP4 {kind} has {rows.shape[1]} rows; the layer expects {inter} x tp_size={size}")
            target = param.data.narrow(1, 0 if kind == "w1" else inter, inter)
            target.copy_(_checked(rows.narrow(1, rank * inter, inter), target.shape))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.w13_blocks.device.type != "cpu" or layer.mxfp4_packed is not None:
            return
        from novainfer.kernels.cpu import library

        if not library.available():
            logger.info("MXFP4 experts: no CPU kernels here; each step dequantizes the experts it routes to")
            return
        from gguf import GGMLQuantizationType

        from novainfer.kernels.cpu.repack import mxfp4_from_hf, repack

        def packed(blocks: torch.Tensor, scales: torch.Tensor) -> list:
            n, k = blocks.shape[1], blocks.shape[2] * 32
            rows = mxfp4_from_hf(blocks, scales)
            return [repack(rows[e].numpy(), GGMLQuantizationType.MXFP4, (n, k)) for e in range(rows.shape[0])]

        layer.mxfp4_packed = (
            packed(layer.w13_blocks.data, layer.w13_scales.data),
            packed(layer.w2_blocks.data, layer.w2_scales.data),
        )
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):  # the panels hold them now
            getattr(layer, name).data = torch.empty(0, dtype=torch.uint8)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        if x.is_cuda:
            from novainfer.kernels.fused_moe_mxfp4 import fused_experts_mxfp4

            w13, w2 = (b.flatten(-2) for b in (layer.w13_blocks, layer.w2_blocks))
            return fused_experts_mxfp4(
                x, w13, layer.w13_scales, w2, layer.w2_scales, topk_weights, topk_ids, layer.act_fn, b13, b2
            )
        if layer.mxfp4_packed is None:
            return _routed_dequantized(layer, x, topk_weights, topk_ids, b13, b2)
        return _experts_cpu(layer, x, topk_weights, topk_ids, b13, b2)


def _as_bytes(loaded: torch.Tensor, experts: int) -> torch.Tensor:
    """The checkpoint tensor as uint8 on the CPU, refused unless it is whole bytes for `experts` experts."""
    if loaded.shape[0] != experts:
        raise ValueError(f"MXFP4 tensor has {loaded.shape[0]} experts, the config {experts}")
    if loaded.dtype == torch.uint8:
        return loaded
    as_int = loaded.to(torch.int32)
    if (
        loaded.is_floating_point()
        and not torch.equal(as_int.to(loaded.dtype), loaded)
        or (as_int < 0).any()
        or (as_int > 255).any()
    ):
        raise ValueError(f"MXFP4 blocks/scales must be bytes (uint8); got {loaded.dtype} values that are not")
    return as_int.to(torch.uint8)


def _draw_blocks(param: nn.Parameter, gen: torch.Generator) -> None:
    """load_format="dummy": uniform random e2m1 codes."""
    param.data.copy_(torch.randint(0, 256, param.shape, dtype=torch.uint8, generator=gen, device=gen.device))


def _draw_scales(param: nn.Parameter, gen: torch.Generator) -> None:
    """load_format="dummy": every block scaled by 2^-7, so the weights' std is about 0.02 (the dense draw's)."""
    param.data.fill_(127 - 7)


def _checked(part: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if part.shape != shape:
        raise ValueError(f"MXFP4 tensor shard has shape {tuple(part.shape)}, the layer expects {tuple(shape)}")
    return part


def _routed_dequantized(layer: nn.Module, x, topk_weights, topk_ids, b13, b2) -> torch.Tensor:
    """The experts the tokens route to, dequantized for this call only (no C kernels on this CPU)."""
    used = torch.unique(topk_ids)
    remap = torch.zeros(layer.num_experts, dtype=torch.long, device=topk_ids.device)
    remap[used] = torch.arange(used.numel(), device=topk_ids.device)
    w13 = dequantize_mxfp4(layer.w13_blocks[used], layer.w13_scales[used], x.dtype)
    w2 = dequantize_mxfp4(layer.w2_blocks[used], layer.w2_scales[used], x.dtype)
    b13 = None if b13 is None else b13[used]
    b2 = None if b2 is None else b2[used]
    return fused_experts_torch(x, w13, w2, topk_weights, remap[topk_ids], layer.act_fn, b13, b2)


def _experts_cpu(layer: nn.Module, x: torch.Tensor, topk_weights, topk_ids, b13, b2) -> torch.Tensor:
    """Each routed expert's tokens through the C MXFP4 GEMMs (float32 activations, rounded per 32 to int16)."""
    from novainfer.kernels.cpu.qgemm import quant_gemm

    w13, w2 = layer.mxfp4_packed
    xf = x.float().contiguous()
    weights = topk_weights.to(x.dtype).float()  # rounded as the reference rounds them
    rows, ys = [], []
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        h = quant_gemm(xf[token_idx], w13[expert])
        if b13 is not None:
            h += b13[expert].float()
        y = quant_gemm(layer.act_fn(h).float().contiguous(), w2[expert])
        if b2 is not None:
            y += b2[expert].float()
        rows.append(token_idx)
        ys.append(y.mul_(weights[token_idx, slot, None]))
    # one scatter-add for all experts: torch's threads and the kernels' pool then meet once a layer, not per expert
    return torch.zeros_like(xf).index_add_(0, torch.cat(rows), torch.cat(ys)).to(x.dtype)


class Mxfp4Config(QuantizationConfig):
    """A checkpoint's MXFP4 experts (FusedMoE layers) get Mxfp4MoEMethod; linear and embedding layers stay dense.
    Built from the config's quantization_config, refused (ValueError naming the field) where it asks for more."""

    def __init__(self, hf_quant_config: dict, device: torch.device, quantization: str | None = None):
        unknown = sorted(set(hf_quant_config) - KNOWN_FIELDS)
        if unknown:
            raise ValueError(f"quantization_config.{unknown[0]} is not supported for quant_method 'mxfp4'")
        if quantization not in (None, "gguf"):  # gguf: a llama.cpp file's MXFP4 experts (loader/gguf_gpt_oss.py)
            raise ValueError(
                f"quantization={quantization!r} does not apply to an MXFP4 checkpoint (its experts are "
                "quantized already); leave quantization unset"
            )
        dense = " ".join(hf_quant_config.get("modules_to_not_convert") or [])
        missing = [m for m in DENSE_MODULES if m not in dense]
        if missing:
            raise ValueError(
                f"quantization_config.modules_to_not_convert does not name {', '.join(missing)}: MXFP4 is "
                "supported for the MoE experts only (every other module unquantized)"
            )
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"MXFP4 experts run on CUDA or the CPU, not on {device.type}")
        self.device = device

    def get_quant_method(self, layer: nn.Module) -> None:
        return None

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase:
        return Mxfp4MoEMethod(self.device)

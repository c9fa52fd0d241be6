"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output), parsed by the
compressed-tensors package itself. Implemented schemes (one config group targeting Linear, `ignore` at most the
lm_head):
- float-quantized FP8 weights per channel or per tensor (weight [N, K] float8_e4m3fn, weight_scale [N, 1] or
  [1]) with activations per token dynamic or per tensor static (input_scale): CtFp8LinearMethod, the product by
  fp8.fp8_linear (torch._scaled_mm with row-wise scales, CUDA sm_89+ or the CPU; a per-tensor scale is kept as
  one per row, a static input scale shared by fused shards is their largest, as vLLM does);
- float-quantized FP8 with 2-D block weight scales and per-token-group dynamic activations (FP8_BLOCK):
  fp8_block.py with weight_scale;
- pack-quantized INT4 weights per group (32/64/128), symmetric or with zero points, no activation quantization
  (W4A16): int4.py.
Anything else is refused at start-up naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from novainfer.layers.quantization.base import FusedMoEMethodBase, QuantizationConfig, QuantizeMethodBase
from novainfer.layers.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Options,
    check_device_support,
    cuda_quantizer,
    fp8_linear,
    quantize_rows,
)
from novainfer.layers.quantization.fp8_block import Fp8BlockMoEMethod, Fp8BlockShard
from novainfer.layers.quantization.prequantized import (
    PrequantizedLinearMethod,
    ShardSlice,
    layer_label,
    quantized_linear,
    refuse_unquantized_modules,
)
from novainfer.layers.quantization.prequantized_moe import PrequantizedMoEMethod, check_moe_kernels


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] to float8 with one fixed float32 scale (a static input_scale): (x_fp8, scale [M, 1])."""
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.view(1, 1).expand(x.shape[0], 1).contiguous()


@dataclass
class CtFp8Shard:
    weight: torch.Tensor  # float8 [n, k]
    scale: torch.Tensor  # float32 [n], one per output row
    input_scale: torch.Tensor | None  # float32 scalar (static activations)


class CtFp8LinearMethod(PrequantizedLinearMethod):
    """A float8 weight with per-row scales as stored; x quantized per token, or with the static input_scale."""

    def __init__(self, opts: Fp8Options, static_input: bool):
        self.opts, self.static_input = opts, static_input
        self.tensor_names = ("weight", "weight_scale") + (("input_scale",) if static_input else ())

    def unpack(self, layer: nn.Module, t: dict[str, torch.Tensor]) -> CtFp8Shard:
        w = t["weight"]
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"compressed-tensors FP8 weight of dtype {w.dtype} in {layer_label(layer)}")
        scale = t["weight_scale"].float().reshape(-1)
        if scale.numel() not in (1, w.shape[0]):
            raise ValueError(f"weight_scale of {scale.numel()} values for a weight {tuple(w.shape)}")
        inp = t["input_scale"].float().reshape(()) if self.static_input else None
        return CtFp8Shard(w, scale.expand(w.shape[0]), inp)

    def take_slice(self, layer: nn.Module, shard: CtFp8Shard, sl: ShardSlice) -> CtFp8Shard:
        if sl.dim == 0:
            rows = slice(sl.start, sl.start + sl.size)
            return CtFp8Shard(shard.weight[rows], shard.scale[rows], shard.input_scale)
        if sl.dim == 1:
            return CtFp8Shard(shard.weight[:, sl.start : sl.start + sl.size], shard.scale, shard.input_scale)
        return shard

    def store(self, layer: nn.Module, shards: list[CtFp8Shard]) -> None:
        weight = torch.cat([s.weight for s in shards]).contiguous()
        if tuple(weight.shape) != (layer.output_size, layer.input_size):
            raise ValueError(f"fp8 weight of shape {tuple(weight.shape)} for {layer_label(layer)}")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.cat([s.scale for s in shards]).view(1, -1).contiguous(), False)
        if self.static_input:
            layer.input_scale = nn.Parameter(torch.stack([s.input_scale for s in shards]).amax(), False)

    def draw_dummy(self, layer: nn.Module, std: float, gen: torch.Generator) -> None:
        """load_format="dummy": N(0, std^2) weights quantized per row (static input scale 1/448 * 4)."""
        w = torch.randn(layer.output_size, layer.input_size, generator=gen, device=gen.device) * std
        q, scale = quantize_rows(w)
        inp = torch.tensor(4.0 / FP8_MAX, device=w.device) if self.static_input else None
        for name in self.tensor_names:
            layer._parameters.pop(name, None)
        layer.stash = {}
        self.store(layer, [CtFp8Shard(q, scale.view(-1), inp)])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        opts = self.opts
        if self.static_input:
            opts = dataclasses.replace(opts, quantize=partial(quantize_static, scale=layer.input_scale))
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, opts)


class CtFp8MoEMethod(Fp8BlockMoEMethod):
    """compressed-tensors FP8 experts per channel (a per-tensor scale kept per row) with dynamic per-token inputs:
    block FP8 whose block is a whole row, (1, max(hidden, inter)), so w13_weight_scale / w2_weight_scale are
    [E, N, 1]; the grouped GEMMs quantize their inputs per token (the dense layers' quantizer)."""

    def __init__(self, opts: Fp8Options):
        PrequantizedMoEMethod.__init__(self, CtFp8LinearMethod(opts, static_input=False))
        self.opts, self.block = opts, (1, 1)

    def check_sizes(self, hidden_size: int, intermediate_size: int, tp_size: int) -> None:
        self.block = (1, max(hidden_size, intermediate_size))  # any width: no tile spans more than one block

    def store(self, layer: nn.Module, experts: list[dict]) -> None:
        rows = [{k: Fp8BlockShard(s.weight, s.scale.reshape(-1, 1)) for k, s in x.items()} for x in experts]
        super().store(layer, rows)

    def quantize(self, layer: nn.Module, side: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
        return {f"{side}_weight": q.view(w.shape), f"{side}_weight_scale": scale.view(*w.shape[:2], 1)}

    def apply_cuda(self, layer: nn.Module, x, topk_weights, topk_ids) -> torch.Tensor:
        return self.kernel()(x, *self.operands(layer), topk_weights, topk_ids, layer.act_fn, None, self.opts.quantize)


class CtFp8Config(QuantizationConfig):
    """Every dense linear layer is a compressed-tensors FP8 one (the embedding and lm_head stay dense)."""

    def __init__(self, device: torch.device, static_input: bool, input_field: str = "input_activations"):
        fuse_bias, fast_accum = check_device_support(device)
        quantize = cuda_quantizer(device) if device.type == "cuda" else quantize_rows
        self.opts = Fp8Options(fuse_bias, fast_accum, quantize)
        self.static_input, self.input_field, self.device = static_input, input_field, device
        self.moe_checked = device.type != "cuda"

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        return CtFp8LinearMethod(self.opts, self.static_input) if quantized_linear(layer) else None

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase:
        if self.static_input:
            raise _refuse(
                f"{self.input_field}.dynamic", False, "static FP8 input scales on MoE experts are not implemented"
            )
        method = CtFp8MoEMethod(self.opts)
        if not self.moe_checked:  # the first MoE layer: the grouped GEMMs on this GPU, once
            check_moe_kernels(method, self.device)
            self.moe_checked = True
        return method

    def keeps_stored_dtype(self, name: str, tensor: torch.Tensor) -> bool:
        return tensor.dtype == FP8_DTYPE or name.endswith((".weight_scale", ".input_scale"))


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r} (compressed-tensors): {why}")


def ct_config(qc: dict, device: torch.device) -> QuantizationConfig:
    """The QuantizationConfig for a compressed-tensors quantization_config; ValueError naming what we lack."""
    from compressed_tensors.quantization import QuantizationConfig as CTConfig

    try:
        cfg = CTConfig.model_validate(qc)
    except Exception as exc:  # pydantic's ValidationError lists every bad field
        raise ValueError(f"quantization_config (compressed-tensors) does not parse: {exc}".splitlines()[0]) from None
    if len(cfg.config_groups) != 1:
        raise _refuse("config_groups", sorted(cfg.config_groups), "exactly one scheme for every Linear is implemented")
    ((group_name, scheme),) = cfg.config_groups.items()
    field = f"config_groups.{group_name}"
    if list(scheme.targets) != ["Linear"]:
        raise _refuse(f"{field}.targets", scheme.targets, "only targets ['Linear'] is implemented")
    refuse_unquantized_modules("ignore", list(cfg.ignore or []), "compressed-tensors")
    if scheme.output_activations is not None:
        raise _refuse(f"{field}.output_activations", "set", "output activation quantization is not implemented")
    if cfg.kv_cache_scheme is not None:
        raise _refuse("kv_cache_scheme", "set", "a quantized KV cache from the checkpoint is not implemented")
    fmt = scheme.format or cfg.format
    w, a = scheme.weights, scheme.input_activations
    if w is None:
        raise _refuse(f"{field}.weights", None, "activation-only quantization is not implemented")
    if fmt == "float-quantized":
        if w.type != "float" or w.num_bits != 8:
            raise _refuse(f"{field}.weights", f"{w.type}{w.num_bits}", "float-quantized means FP8 (float, 8 bits)")
        if a is None or a.type != "float" or a.num_bits != 8:
            raise _refuse(f"{field}.input_activations", a and f"{a.type}{a.num_bits}", "FP8 weights need FP8 inputs")
        if w.strategy == "block":
            from novainfer.layers.quantization.fp8_block import Fp8BlockConfig

            block = tuple(w.block_structure or ())
            if not (a.strategy == "group" and a.dynamic and len(block) == 2 and a.group_size == block[1]):
                raise _refuse(f"{field}.input_activations.strategy", a.strategy, "block FP8 needs dynamic groups")
            return Fp8BlockConfig((int(block[0]), int(block[1])), device, scale_name="weight_scale")
        if w.strategy not in ("channel", "tensor"):
            raise _refuse(f"{field}.weights.strategy", w.strategy, "FP8 weights per channel, tensor or block only")
        if (a.strategy, bool(a.dynamic)) not in (("token", True), ("tensor", False)):
            raise _refuse(
                f"{field}.input_activations",
                f"{a.strategy}/dynamic={a.dynamic}",
                "per-token dynamic or per-tensor static FP8 activations only",
            )
        return CtFp8Config(device, not a.dynamic, f"{field}.input_activations")
    if fmt == "pack-quantized":
        from novainfer.layers.quantization.int4 import GROUP_SIZES, Int4Config, Int4Format

        if w.type != "int" or w.num_bits != 4:
            raise _refuse(f"{field}.weights.num_bits", w.num_bits, "only 4-bit integer packed weights are implemented")
        if a is not None:
            raise _refuse(f"{field}.input_activations", a.strategy, "pack-quantized is implemented as W4A16 only")
        if w.strategy != "group" or w.group_size not in GROUP_SIZES:
            raise _refuse(f"{field}.weights.group_size", w.group_size, f"group strategy with {GROUP_SIZES} only")
        if w.actorder == "group":
            raise _refuse(f"{field}.weights.actorder", "group", "the weight_g_idx layout is not implemented")
        return Int4Config(Int4Format("pack-quantized", int(w.group_size), symmetric=bool(w.symmetric)), device)
    raise _refuse("format", fmt, "implemented are float-quantized (FP8) and pack-quantized (INT4)")

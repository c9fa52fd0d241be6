"""Pre-quantized FP8 with block scales (`quant_method: fp8, weight_block_size: [128, 128]`, Qwen3-FP8 and
DeepSeek-V3 style; compressed-tensors' FP8_BLOCK scheme is the same layout with weight_scale).

The checkpoint's weight is float8_e4m3fn [N, K] with one float32 scale per [bn, bk] block, weight_scale_inv
[ceil(N/bn), ceil(K/bk)] (a multiplier, despite the name); activations are quantized at run time per token per
bk-wide group (scale amax/448, activation_scheme dynamic). The weight stays as stored; a fused layer stacks its
shards' rows and scale rows, which needs each shard (and each rank's slice) to cover whole blocks.

On CUDA (sm_89+) kernels/fp8_block.py's fp8_block_linear runs: weight-only at one row (x stays bf16), above it the
per-token-group quantization and a block-scaled float8 GEMM (cuBLAS's from 48-128 rows on Hopper, else the Triton one;
where cuBLAS has none, the dequantized weight and cuBLAS's bf16 GEMM for prefill).
The torch references are the CPU path: weight_only_reference at one row, as the GPU's GEMV; above, quantize_groups
and block_reference (both operands dequantized, a float32 matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from novainfer.layers.quantization.base import FusedMoEMethodBase, QuantizationConfig, QuantizeMethodBase
from novainfer.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.quantization.prequantized import (
    PrequantizedLinearMethod,
    ShardSlice,
    layer_label,
    probe_kernels,
    quantized_linear,
    refuse_unquantized_modules,
    shard_slices,
)
from novainfer.layers.quantization.prequantized_moe import PrequantizedMoEMethod, check_moe_kernels


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> float8 [M, K] and float32 scales [M, ceil(K / group)], each group scaled by amax/448."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(-1, keepdim=True).div_(FP8_MAX).clamp_(min=MIN_SCALE)
    q = xf.div(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return q, scale.view(m, groups)


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one per element [N, K]."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def block_reference(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The torch reference: x quantized per token-group, both operands dequantized, float32 matmul -> [M, N]."""
    q, s = quantize_groups(x, block[1])
    xd = q.float() * s.repeat_interleave(block[1], 1)[:, : x.shape[1]]
    wd = weight.float() * expand_blocks(w_scale.float(), block, tuple(weight.shape))
    return xd @ wd.T


def weight_only_reference(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The torch reference of the weight-only path (few rows): x as it is times the dequantized weight -> [M, N]."""
    return x.float() @ (weight.float() * expand_blocks(w_scale.float(), block, tuple(weight.shape))).T


@dataclass
class Fp8BlockShard:
    weight: torch.Tensor  # float8 [n, k]
    scale: torch.Tensor  # float32 [ceil(n/bn), ceil(k/bk)]


class Fp8BlockLinearMethod(PrequantizedLinearMethod):
    """A linear layer whose float8 weight and block scales stay as the checkpoint stores them."""

    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv"):
        self.block, self.scale_name = block, scale_name
        self.tensor_names = ("weight", scale_name)

    def check_layer(self, layer: nn.Module) -> None:
        slices = list(shard_slices(layer).values())
        bn, bk = self.block
        for sl in slices:
            fused_or_split = len(slices) > 1 or sl.dim == 0 and layer.tp_size > 1
            if sl.dim == 1 and (sl.start % bk or sl.size % bk) or fused_or_split and (sl.start % bn or sl.size % bn):
                raise ValueError(
                    f"quantization_config.weight_block_size={list(self.block)} does not divide the slices of "
                    f"{layer_label(layer)} ({'columns' if sl.dim == 1 else 'rows'} {sl.start}..{sl.start + sl.size})"
                    ": its fused shards and tensor-parallel splits must cover whole blocks"
                )

    def unpack(self, layer: nn.Module, t: dict[str, torch.Tensor]) -> Fp8BlockShard:
        w, s = t["weight"], t[self.scale_name].float()
        if w.dtype != FP8_DTYPE:
            raise ValueError(
                f"fp8 checkpoint weight of dtype {w.dtype} (expected float8_e4m3fn) in {layer_label(layer)}"
            )
        want = (-(-w.shape[0] // self.block[0]), -(-w.shape[1] // self.block[1]))
        if tuple(s.shape) != want:
            raise ValueError(f"{self.scale_name} of shape {tuple(s.shape)} for a weight {tuple(w.shape)}: want {want}")
        return Fp8BlockShard(w, s)

    def take_slice(self, layer: nn.Module, shard: Fp8BlockShard, sl: ShardSlice) -> Fp8BlockShard:
        if sl.dim is None:
            return shard
        b = self.block[sl.dim]
        return Fp8BlockShard(
            shard.weight.narrow(sl.dim, sl.start, sl.size), shard.scale.narrow(sl.dim, sl.start // b, -(-sl.size // b))
        )

    def store(self, layer: nn.Module, shards: list[Fp8BlockShard]) -> None:
        weight = torch.cat([s.weight for s in shards]).contiguous()
        if tuple(weight.shape) != (layer.output_size, layer.input_size):
            raise ValueError(f"fp8 weight of shape {tuple(weight.shape)} for {layer_label(layer)}")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(torch.cat([s.scale for s in shards]).contiguous(), requires_grad=False)

    def draw_dummy(self, layer: nn.Module, std: float, gen: torch.Generator) -> None:
        """load_format="dummy": N(0, std^2) weights quantized per block into the stored layout."""
        n, k = layer.output_size, layer.input_size
        w = torch.randn(n, k, generator=gen, device=gen.device) * std
        bn, bk = self.block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
        scale = padded.abs().amax(dim=(1, 3)).clamp(min=MIN_SCALE) / FP8_MAX
        full = expand_blocks(scale, self.block, (n, k))
        layer._parameters.pop(self.scale_name, None)
        layer.stash = {}
        self.store(layer, [Fp8BlockShard((w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w, s = layer.weight, layer.weight_scale_inv
        if x2.is_cuda:
            from novainfer.kernels.fp8_block import fp8_block_linear

            y = fp8_block_linear(x2.contiguous(), w, s, self.block)
        elif x2.shape[0] == 1:  # as the GPU's one-row GEMV: weight-only, x as it is
            y = weight_only_reference(x2, w, s, self.block).to(x.dtype)
        else:
            y = block_reference(x2, w, s, self.block).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])


def dequantize_fp8_block_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Stacked float8 experts [E, N, K] and block scales [E, N/bn, K/bk] -> float32 [E, N, K] (the reference)."""
    return torch.stack([wi.float() * expand_blocks(si.float(), block, tuple(wi.shape)) for wi, si in zip(w, scale)])


def fused_experts_fp8_block_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
    quantize_activations: bool,
) -> torch.Tensor:
    """The torch reference of kernels/fused_moe_quant.fused_experts_fp8_block in float32: the experts dequantized,
    each GEMM's input quantized per token group first where quantize_activations (fp8_block.quantize_groups), the
    intermediate rounded to x's dtype before that, as the kernel holds it."""

    def rounded(h: torch.Tensor) -> torch.Tensor:
        if not quantize_activations:
            return h
        q, s = quantize_groups(h, block[1])
        return q.float() * s.repeat_interleave(block[1], 1)[:, : h.shape[1]]

    class _ActThenRound(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:  # the kernel's gate/up output and activation in x's dtype
            return rounded(act_and_mul(h.to(x.dtype)).float())

    d13 = dequantize_fp8_block_experts(w13, w13_scale, block)
    d2 = dequantize_fp8_block_experts(w2, w2_scale, block)
    return fused_experts_torch(rounded(x.float()), d13, d2, topk_weights, topk_ids, _ActThenRound())


class Fp8BlockMoEMethod(PrequantizedMoEMethod):
    """Block-scaled FP8 experts as stored (quant_method fp8 with weight_block_size; compressed-tensors FP8_BLOCK)."""

    def __init__(self, block: tuple[int, int], scale_name: str):
        super().__init__(Fp8BlockLinearMethod(block, scale_name))
        self.block = block

    def check_sizes(self, hidden_size: int, intermediate_size: int, tp_size: int) -> None:
        bn, bk = self.block
        for what, size, b in (
            ("hidden_size", hidden_size, bk),
            ("moe intermediate_size per tensor-parallel rank (gate/up rows)", intermediate_size, bn),
            ("moe intermediate_size per tensor-parallel rank (down columns)", intermediate_size, bk),
        ):
            if size % b:
                raise ValueError(
                    f"quantization_config.weight_block_size={list(self.block)} does not divide the experts' {what} "
                    f"({size}, tp_size={tp_size}): block FP8 experts need whole blocks"
                )

    def store(self, layer: nn.Module, experts: list[dict]) -> None:
        def stack(kinds: tuple[str, ...], attr: str) -> torch.Tensor:
            return torch.stack([torch.cat([getattr(x[k], attr) for k in kinds]) for x in experts])

        self.set_stored(
            layer,
            {
                "w13_weight": stack(("w1", "w3"), "weight"),
                "w13_weight_scale": stack(("w1", "w3"), "scale"),
                "w2_weight": stack(("w2",), "weight"),
                "w2_weight_scale": stack(("w2",), "scale"),
            },
        )

    def dequantized(self, layer: nn.Module, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            dequantize_fp8_block_experts(
                getattr(layer, f"{s}_weight")[experts], getattr(layer, f"{s}_weight_scale")[experts], self.block
            )
            for s in ("w13", "w2")
        )

    def quantize(self, layer: nn.Module, side: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        e, n, k = w.shape
        bn, bk = self.block
        blocks = w.view(e, n // bn, bn, k // bk, bk)
        scale = blocks.abs().amax(dim=(2, 4)).clamp(min=MIN_SCALE) / FP8_MAX
        full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return {f"{side}_weight": q, f"{side}_weight_scale": scale.float()}

    def operands(self, layer: nn.Module) -> tuple:
        return layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale, self.block

    def kernel(self):
        from novainfer.kernels.fused_moe_quant import fused_experts_fp8_block

        return fused_experts_fp8_block

    @staticmethod
    def reference_fn(*args) -> torch.Tensor:
        return fused_experts_fp8_block_reference(*args)


def check_block_device(device: torch.device, what: str) -> None:
    """Raise ValueError where the block FP8 kernels cannot run (float8 tl.dot needs sm_89+)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"{what} needs an NVIDIA GPU of compute capability 8.9 or newer; this is sm_{cap[0]}{cap[1]}"
            )
    elif device.type != "cpu":
        raise ValueError(f"{what} runs on CUDA (sm_89+) or the CPU, not on {device.type}")


class Fp8BlockConfig(QuantizationConfig):
    """Every dense linear layer is block-scaled FP8 as stored (the embedding and lm_head stay in the model's dtype)."""

    def __init__(self, block: tuple[int, int], device: torch.device, scale_name: str = "weight_scale_inv"):
        check_block_device(device, "a block-scaled FP8 checkpoint")
        if device.type == "cuda":
            check_block_kernels(device, block)
        self.block, self.scale_name, self.device = block, scale_name, device
        self.moe_checked = device.type != "cuda"

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        return Fp8BlockLinearMethod(self.block, self.scale_name) if quantized_linear(layer) else None

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase:
        method = Fp8BlockMoEMethod(self.block, self.scale_name)
        if not self.moe_checked:  # the first MoE layer: the grouped GEMMs on this GPU, once
            check_moe_kernels(method, self.device)
            self.moe_checked = True
        return method

    def keeps_stored_dtype(self, name: str, tensor: torch.Tensor) -> bool:
        return tensor.dtype == FP8_DTYPE or name.endswith("." + self.scale_name)


def fp8_block_config(qc: dict, device: torch.device) -> Fp8BlockConfig:
    """The config of a `quant_method: fp8` checkpoint; ValueError naming the field we do not implement."""
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(
            "quantization_config.weight_block_size is missing (quant_method fp8): only block-scaled FP8 "
            "checkpoints are implemented (per-tensor FP8 checkpoints: use compressed-tensors ones)"
        )
    if len(block) != 2 or any(b not in (64, 128) for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block}: implemented are [128, 128] and [64, 64]")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme={qc['activation_scheme']!r}: only dynamic is implemented"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r}: only e4m3 (float8_e4m3fn) is implemented")
    for field in ("modules_to_not_convert", "ignored_layers"):
        refuse_unquantized_modules(field, qc.get(field), "fp8")
    return Fp8BlockConfig((int(block[0]), int(block[1])), device)


def check_block_kernels(device: torch.device, block: tuple[int, int]) -> None:
    """Every path of fp8_block_linear (the GEMV, the quantize + GEMM, dequantize + dense) against its torch reference
    on small operands, once at start-up."""
    from novainfer.kernels.fp8_block import CUBLAS_MIN_M, DEQUANT_MIN_M, GEMV_MAX_M, fp8_block_linear, takes_cublas

    g = torch.Generator(device=device).manual_seed(0)
    n, k = 2 * block[0], 4 * block[1]  # four K blocks: cuBLAS's path runs where the blocks are 128x128
    weight = (torch.randn(n, k, generator=g, device=device) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    w_scale = torch.rand(2, 4, generator=g, device=device) * 1e-3 + 1e-4
    cases = []
    for m in (1, 8, 40, CUBLAS_MIN_M + 3, DEQUANT_MIN_M):  # each path of fp8_block_linear, against its product
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
        quantized = GEMV_MAX_M < m and (m < DEQUANT_MIN_M or takes_cublas(x, weight, block))
        ref = block_reference if quantized else weight_only_reference
        cases.append((fp8_block_linear(x, weight, w_scale, block), ref(x, weight, w_scale, block)))
    probe_kernels(f"block FP8 (weight_block_size={list(block)})", cases, 2e-2)

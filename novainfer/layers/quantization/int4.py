"""INT4 weight-only (W4A16) checkpoints: GPTQ, AWQ and compressed-tensors pack-quantized, kept 4-bit.

Each format's tensors are unpacked at load to one logical form per shard (codes 0..15 [N, K], scales and zero
points [N, K/G], GPTQ's g_idx), sliced for this rank, stacked, and packed into the one layout the kernels read
(kernels/int4_gemm.py: codes int32 [N, K/8] packed along K, interleaved by 32 inputs; scales [N, K/G] in the
checkpoint's dtype, zero points [N, K/G] uint8),
w[n, k] = (code - zero) * scale. The formats differ only in unpack():
- GPTQ: qweight int32 [K/8, N] (row 8i+j in bits 4j), qzeros int32 [K/G, N/8] (column 8i+j in bits 4j; stored
  as zero - 1 unless checkpoint_format is gptq_v2), scales [K/G, N], g_idx [K] (the group of each input row;
  with desc_act, not k // G: the rows are sorted by group at load and x's columns gathered in that order).
- AWQ (GEMM version): qweight int32 [K, N/8] and qzeros [K/G, N/8] packed along N with AWQ's interleaved order
  (column 8i + AWQ_ORDER[j] in bits 4j), scales [K/G, N].
- compressed-tensors pack-quantized (compressed_tensors.py): weight_packed int32 [N, K/8] (column 8i+j in bits
  4j, stored as code + 8 of the signed value), weight_scale [N, K/G], weight_zero_point int32 [N/8, K/G] packed
  along N when asymmetric (else the zero point is 8), weight_shape.
On CUDA a few rows of x go through the GEMV, more through the dequantize-in-tile GEMM; on the CPU the torch
reference runs (dequantize_int4, then a float matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from novainfer.layers.quantization.base import FusedMoEMethodBase, QuantizationConfig, QuantizeMethodBase
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

PACK = 8  # 4-bit codes per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j] of its eight
GROUP_SIZES = (32, 64, 128)
UNSUPPORTED_FIELDS = {  # set (truthy) in a GPTQ / AWQ quantization_config, each changes what the layers hold
    "dynamic": "a per-module override of bits or group size",
    "lm_head": "a quantized lm_head",
    "is_marlin_format": "the Marlin-repacked layout",
}


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """int32 words -> 4-bit codes (uint8) along dim, eight per word; nibble j is element order[j] of its eight."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8] (dim moved last below)
    nib = nib.movedim(dim, -2) if dim != packed.dim() - 1 else nib
    inv = torch.empty(PACK, dtype=torch.long)
    inv[list(order)] = torch.arange(PACK)
    nib = nib[..., inv]  # element e of each eight comes from nibble inv[e]
    out = nib.reshape(*nib.shape[:-2], -1).to(torch.uint8)
    return out.movedim(-1, dim) if dim != packed.dim() - 1 else out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, K a multiple of 32) -> the kernels' int32 [N, K/8]: of each 32 inputs, input 4j + w in
    nibble j of word w (kernels/int4_gemm.py says why)."""
    n, k = codes.shape
    c = codes.to(torch.int32).reshape(n, k // 32, PACK, 4)  # [N, chunk, j, w]
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int32).view(1, 1, PACK, 1)
    return (c << shifts).sum(dim=2, dtype=torch.int32).view(n, k // PACK)  # disjoint bits: the sum is the or


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The kernels' int32 [N, K/8] -> codes uint8 [N, K] (pack_int4's inverse)."""
    n, words = qweight.shape
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32).view(1, 1, PACK, 1)
    nib = (qweight.view(n, words // 4, 1, 4) >> shifts) & 0xF  # [N, chunk, j, w]
    return nib.reshape(n, words * PACK).to(torch.uint8)


@dataclass
class Int4Shard:
    """One shard's logical form: codes uint8 [N, K], scales (as stored) and zero points (uint8) [N, K/G], g_idx [K]
    or None."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The kernels' layout -> float32 W^T [K, N] (the torch reference: x @ it)."""
    codes = unpack_int4(qweight).float()
    return ((codes - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)).T


@dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's quantization_config says about its INT4 layers."""

    name: str  # gptq, awq, pack-quantized
    group_size: int
    symmetric: bool = True
    desc_act: bool = False
    zeros_minus_one: bool = False  # GPTQ v1 stores zero - 1


class Int4LinearMethod(PrequantizedLinearMethod):
    """A linear layer stored as 4-bit codes in the kernels' layout; see the module docstring."""

    def __init__(self, fmt: Int4Format):
        self.fmt = fmt
        self.tensor_names = {
            "gptq": ("qweight", "qzeros", "scales", "g_idx"),
            "awq": ("qweight", "qzeros", "scales"),
            "pack-quantized": ("weight_packed", "weight_scale", "weight_shape")
            + (() if fmt.symmetric else ("weight_zero_point",)),
        }[fmt.name]

    def check_layer(self, layer: nn.Module) -> None:
        g = self.fmt.group_size
        for sl in shard_slices(layer).values():
            if sl.dim == 1 and sl.start % g or sl.dim == 1 and sl.size % g:
                raise ValueError(
                    f"quantization_config.group_size={g} does not divide this rank's input columns ({sl.size}) of "
                    f"{layer_label(layer)}: tensor parallelism must split INT4 weights on group boundaries"
                )
            if sl.dim == 1 and self.fmt.desc_act and layer.tp_size > 1:
                raise ValueError(
                    f"quantization_config.desc_act=true with tensor_parallel_size={layer.tp_size}: an act-order "
                    f"row-parallel layer ({layer_label(layer)}) is not supported; use tensor_parallel_size=1"
                )
        if layer.input_size % g:
            raise ValueError(f"quantization_config.group_size={g} does not divide {layer_label(layer)}'s input size")

    def unpack(self, layer: nn.Module, t: dict[str, torch.Tensor]) -> Int4Shard:
        fmt, g = self.fmt, self.fmt.group_size
        if fmt.name == "gptq":
            codes = unpack_int32(t["qweight"], 0).T  # [N, K]
            zeros = unpack_int32(t["qzeros"], 1)  # [K/G, N]
            if fmt.zeros_minus_one:  # v1 stores zero - 1; a zero of 0 was stored as 15 (4 bits wrap)
                zeros = (zeros + 1) & 0xF
            g_idx = t["g_idx"].long()
            if torch.equal(g_idx, torch.arange(g_idx.numel(), device=g_idx.device) // g):
                g_idx = None
            elif not fmt.desc_act:
                raise ValueError("GPTQ checkpoint has a permuted g_idx but quantization_config.desc_act is false")
            return Int4Shard(codes, t["scales"].T, zeros.T, g_idx)
        if fmt.name == "awq":
            codes = unpack_int32(t["qweight"], 1, AWQ_ORDER).T
            zeros = unpack_int32(t["qzeros"], 1, AWQ_ORDER).T
            return Int4Shard(codes, t["scales"].T, zeros, None)
        n, k = (int(v) for v in t["weight_shape"].tolist())
        codes = unpack_int32(t["weight_packed"], 1)[:, :k]
        scales = t["weight_scale"]
        if fmt.symmetric:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8, device=scales.device)
        else:
            zeros = unpack_int32(t["weight_zero_point"], 0)[:n]
        return Int4Shard(codes, scales, zeros, None)

    def take_slice(self, layer: nn.Module, shard: Int4Shard, sl: ShardSlice) -> Int4Shard:
        if sl.dim is None or sl.size == shard.codes.shape[sl.dim]:
            return shard
        if sl.dim == 0:
            rows = slice(sl.start, sl.start + sl.size)
            return Int4Shard(shard.codes[rows], shard.scales[rows], shard.zeros[rows], shard.g_idx)
        g = self.fmt.group_size
        cols, groups = slice(sl.start, sl.start + sl.size), slice(sl.start // g, (sl.start + sl.size) // g)
        return Int4Shard(shard.codes[:, cols], shard.scales[:, groups], shard.zeros[:, groups], None)

    def store(self, layer: nn.Module, shards: list[Int4Shard]) -> None:
        g = self.fmt.group_size
        g_idx = shards[0].g_idx
        if any(
            (s.g_idx is None) != (g_idx is None) or s.g_idx is not None and not torch.equal(s.g_idx, g_idx)
            for s in shards
        ):
            raise ValueError("GPTQ desc_act: the fused shards of a layer (q/k/v, gate/up) have different g_idx")
        codes = torch.cat([s.codes for s in shards])
        scales, zeros = torch.cat([s.scales for s in shards]), torch.cat([s.zeros for s in shards])
        perm = None
        if g_idx is not None:
            counts = torch.bincount(g_idx, minlength=scales.shape[1])
            if counts.numel() != scales.shape[1] or bool((counts != g).any()):
                raise ValueError(f"GPTQ g_idx does not put group_size={g} input rows in every group")
            perm = torch.argsort(g_idx, stable=True)
            codes = codes[:, perm]
        if codes.shape != (layer.output_size, layer.input_size):
            raise ValueError(f"INT4 weight of shape {tuple(codes.shape)} for {layer_label(layer)}")
        self._set(layer, pack_int4(codes), scales.contiguous(), zeros.contiguous(), perm)

    def _set(self, layer: nn.Module, qweight, scales, zeros, perm) -> None:
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.scales = nn.Parameter(scales, requires_grad=False)  # as stored (fp16 for GPTQ / AWQ): exact
        layer.qzeros = nn.Parameter(zeros.to(torch.uint8), requires_grad=False)
        layer.perm = perm

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int):
        layer.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built
        return super().create_weights(layer, output_size, input_size)

    def draw_dummy(self, layer: nn.Module, std: float, gen: torch.Generator) -> None:
        """load_format="dummy": N(0, std^2) weights quantized symmetrically per group into the stored layout."""
        g = self.fmt.group_size
        w = torch.randn(layer.output_size, layer.input_size, generator=gen, device=gen.device) * std
        wg = w.view(w.shape[0], -1, g)
        scales = (wg.abs().amax(2) / 7).clamp(min=1e-8)  # [N, K/G]
        codes = (wg / scales[:, :, None]).round().clamp(-8, 7).add(8).view_as(w).to(torch.uint8)
        for name in self.tensor_names:
            layer._parameters.pop(name, None)
        layer.stash = {}
        zeros = torch.full(scales.shape, 8, dtype=torch.uint8, device=scales.device)
        self._set(layer, pack_int4(codes), scales.to(layer.act_dtype), zeros, None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        g = self.fmt.group_size
        if x2.is_cuda:
            from novainfer.kernels.int4_gemm import int4_linear

            y = int4_linear(x2.contiguous(), layer.qweight, layer.scales, layer.qzeros, g)
        else:
            w = dequantize_int4(layer.qweight, layer.scales, layer.qzeros, g)
            y = (x2.float() @ w).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])


def dequantize_int4_experts(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """Stacked INT4 experts (qweight [E, N, K/8], scales / zeros [E, N, K/G]) -> float32 [E, N, K]."""
    e, n, words = qweight.shape
    codes = unpack_int4(qweight.reshape(e * n, words)).view(e, n, words * 8).float()
    return (codes - zeros.float().repeat_interleave(group, 2)) * scales.float().repeat_interleave(group, 2)


def fused_experts_int4_reference(
    x: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_zeros: torch.Tensor,
    group: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: nn.Module,
) -> torch.Tensor:
    """The torch reference of kernels/fused_moe_quant.fused_experts_int4 (same arguments) in float32."""
    d13 = dequantize_int4_experts(w13_qweight, w13_scales, w13_zeros, group)
    d2 = dequantize_int4_experts(w2_qweight, w2_scales, w2_zeros, group)
    return fused_experts_torch(x.float(), d13, d2, topk_weights, topk_ids, act_and_mul)


class Int4MoEMethod(PrequantizedMoEMethod):
    """INT4 experts (GPTQ without act-order, AWQ, compressed-tensors pack-quantized) in int4.py's kernel layout."""

    def __init__(self, linear: Int4LinearMethod):
        super().__init__(linear)
        self.group = linear.fmt.group_size

    def check_sizes(self, hidden_size: int, intermediate_size: int, tp_size: int) -> None:
        for what, size in (
            ("hidden_size", hidden_size),
            ("moe intermediate_size per tensor-parallel rank", intermediate_size),
        ):
            if size % self.group:
                raise ValueError(
                    f"quantization_config.group_size={self.group} does not divide the experts' {what} ({size}, "
                    f"tp_size={tp_size}): INT4 experts need whole groups"
                )

    def store(self, layer: nn.Module, experts: list[dict]) -> None:
        stored = {}
        for side, kinds in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            shards: list[list[Int4Shard]] = [[x[k] for k in kinds] for x in experts]
            if any(s.g_idx is not None for row in shards for s in row):
                raise ValueError(
                    "quantization_config.desc_act: an expert's g_idx is permuted (act-order); act-order MoE experts "
                    "are not implemented"
                )
            codes = torch.stack([torch.cat([s.codes for s in row]) for row in shards])
            e, n, k = codes.shape
            stored[f"{side}_qweight"] = pack_int4(codes.view(e * n, k)).view(e, n, k // 8)
            stored[f"{side}_scales"] = torch.stack([torch.cat([s.scales for s in row]) for row in shards])
            stored[f"{side}_qzeros"] = torch.stack([torch.cat([s.zeros for s in row]) for row in shards]).to(
                torch.uint8
            )
        self.set_stored(layer, stored)

    def dequantized(self, layer: nn.Module, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            dequantize_int4_experts(
                getattr(layer, f"{s}_qweight")[experts],
                getattr(layer, f"{s}_scales")[experts],
                getattr(layer, f"{s}_qzeros")[experts],
                self.group,
            )
            for s in ("w13", "w2")
        )

    def quantize(self, layer: nn.Module, side: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        e, n, k = w.shape
        g = self.group
        wg = w.view(e, n, k // g, g)
        scales = (wg.abs().amax(-1) / 7).clamp(min=1e-8)
        codes = (wg / scales[..., None]).round().clamp(-8, 7).add(8).view(e * n, k).to(torch.uint8)
        return {
            f"{side}_qweight": pack_int4(codes).view(e, n, k // 8),
            f"{side}_scales": scales.to(layer.act_dtype),
            f"{side}_qzeros": torch.full(scales.shape, 8, dtype=torch.uint8, device=w.device),
        }

    def operands(self, layer: nn.Module) -> tuple:
        w13 = (layer.w13_qweight, layer.w13_scales, layer.w13_qzeros)
        return (*w13, layer.w2_qweight, layer.w2_scales, layer.w2_qzeros, self.group)

    def kernel(self):
        from novainfer.kernels.fused_moe_quant import fused_experts_int4

        return fused_experts_int4

    @staticmethod
    def reference_fn(*args) -> torch.Tensor:
        return fused_experts_int4_reference(*args[:-1])  # no activation quantization to follow


class Int4Config(QuantizationConfig):
    """Every dense linear layer is INT4 (the embedding and lm_head stay in the model's dtype)."""

    STORED = (
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
    )

    def __init__(self, fmt: Int4Format, device: torch.device):
        if device.type == "cuda":
            check_int4_kernels(device, fmt.group_size)
        self.fmt, self.device = fmt, device
        self.moe_checked = device.type != "cuda"

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        return Int4LinearMethod(self.fmt) if quantized_linear(layer) else None

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethodBase:
        if self.fmt.desc_act:
            raise ValueError(
                f"quantization_config.desc_act=true ({self.fmt.name}): act-order (a permuted g_idx) MoE experts are "
                "not implemented"
            )
        method = Int4MoEMethod(Int4LinearMethod(self.fmt))
        if not self.moe_checked:  # the first MoE layer: the grouped GEMMs on this GPU, once
            check_moe_kernels(method, self.device)
            self.moe_checked = True
        return method

    def keeps_stored_dtype(self, name: str, tensor: torch.Tensor) -> bool:
        return name.rsplit(".", 1)[-1] in self.STORED


def int4_format(qc: dict) -> Int4Format:
    """The Int4Format of a GPTQ or AWQ quantization_config; ValueError naming the field we do not implement."""
    method = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits={bits} ({method}): only 4-bit weights are implemented")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise ValueError(f"quantization_config.group_size={group} ({method}): implemented are {GROUP_SIZES}")
    refuse_unquantized_modules("modules_to_not_convert", qc.get("modules_to_not_convert"), method)
    for key, why in UNSUPPORTED_FIELDS.items():
        if qc.get(key):
            raise ValueError(f"quantization_config.{key}={qc[key]!r} ({method}): {why} is not supported")
    if method == "gptq":
        fmt_name = qc.get("checkpoint_format", "gptq")
        if fmt_name not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format={fmt_name!r} (gptq): gptq or gptq_v2 only")
        return Int4Format("gptq", group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt_name == "gptq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version={version!r} (awq): only the GEMM packing is implemented")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point=false (awq): only AWQ with zero points is implemented")
    return Int4Format("awq", group, symmetric=False)


def check_int4_kernels(device: torch.device, group: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """The GEMV and the GEMM against dequantize_int4 on small operands of this device, once at start-up (dtype: the
    activations'; tests pass float32, as the CPU interpreter's bfloat16 tl.dot is wrong)."""
    from novainfer.kernels.int4_gemm import int4_gemm, int4_gemv

    g = torch.Generator(device=device).manual_seed(0)
    k, n = 2 * group, 64
    codes = torch.randint(0, 16, (n, k), generator=g, device=device, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g, device=device) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, device=device).to(torch.uint8)
    qweight = pack_int4(codes)
    w = dequantize_int4(qweight, scales, zeros, group)
    x1, x2 = (torch.randn(m, k, generator=g, device=device).to(dtype) for m in (1, 40))
    cases = [(int4_gemv(x1, qweight, scales, zeros, group), x1.float() @ w)]
    cases.append((int4_gemm(x2, qweight, scales, zeros, group), x2.float() @ w))
    probe_kernels(f"INT4 (group_size={group})", cases, 2e-2)

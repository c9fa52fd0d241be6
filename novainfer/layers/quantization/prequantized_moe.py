"""Pre-quantized MoE experts (block FP8, GPTQ / AWQ / compressed-tensors INT4) kept quantized in a FusedMoE layer.

The checkpoint stores each expert's projections as the dense format does (experts.E.gate_proj.weight +
weight_scale_inv; qweight / qzeros / scales / g_idx; weight_packed / weight_scale / weight_zero_point). The layer
registers one placeholder per format tensor name and stacked side (w13_<name>, w2_<name>; the model maps
experts.E.<proj>.<name> to them with shard id (E, w1 | w3 | w2)), stashes what arrives, and once every tensor is
in, unpacks each with the dense format's own unpack, takes this rank's slice (gate/up rows, down columns) and
stacks the experts (each format's subclass, beside its dense method: fp8_block.Fp8BlockMoEMethod,
int4.Int4MoEMethod):
- block FP8: w13_weight float8 [E, 2I, H] (gate rows then up rows), w13_weight_scale [E, 2I/bn, H/bk], w2_weight
  [E, H, I], w2_weight_scale [E, H/bn, I/bk] (I this rank's intermediate size; whole blocks on each side);
- INT4: int4.py's kernel layout per expert, stacked: w13_qweight int32 [E, 2I, H/8], w13_scales (as stored) and
  w13_qzeros uint8 [E, 2I, H/G], likewise w2_* [E, H, I/8], [E, H, I/G]. Act-order (a permuted g_idx) is refused.
On CUDA kernels/fused_moe_quant.py runs them; on the CPU, as the dense layers do, each call dequantizes the experts
it routes to (float32) and runs the torch experts (weight-only: the activations stay as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.quantization.base import FusedMoEMethodBase
from novainfer.layers.quantization.prequantized import PrequantizedLinearMethod, ShardSlice

# the formats' per-expert tensor names besides weight (the model maps experts.E.<proj>.<name> to w13_ / w2_<name>)
EXPERT_TENSOR_NAMES = (
    "weight_scale_inv",
    "weight_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_zero_point",
    "weight_shape",
)


@dataclass
class ExpertProjection:
    """One expert projection's shape, for the dense unpackers' messages: [N, K] as the checkpoint stores it."""

    output_size: int
    input_size: int
    tp_size: int


class PrequantizedMoEMethod(FusedMoEMethodBase):
    """Collects the experts' checkpoint tensors and stacks them (the module docstring); subclasses store and run."""

    def __init__(self, linear: PrequantizedLinearMethod):
        self.linear = linear

    def check_sizes(self, hidden_size: int, intermediate_size: int, tp_size: int) -> None:
        """Raise ValueError naming the config field where the experts' shapes break the format's boundaries."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        self.check_sizes(hidden_size, intermediate_size, layer.tp_size)
        layer.hidden_size, layer.stash = hidden_size, {}
        layer.act_dtype = torch.get_default_dtype()  # the model's dtype while it is built
        for side in ("w13", "w2"):
            for name in self.linear.tensor_names:
                param = nn.Parameter(torch.empty(0), requires_grad=False)
                param.weight_loader = partial(self._stash, layer, name)
                param.per_expert = True  # filled from experts.E.<proj>.<name> (models/moe.py)
                layer.register_parameter(f"{side}_{name}", param)

    def _stash(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, kind = shard_id
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} out of range: the config has {layer.num_experts} experts")
        layer.stash[(name, expert, kind)] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.stash:
            return  # done already, or drawn by draw_dummy
        inter, hidden, rank, size = layer.local_inter, layer.hidden_size, layer.tp_rank, layer.tp_size
        slices = {
            "w1": (ExpertProjection(inter * size, hidden, size), ShardSlice(0, rank * inter, inter)),
            "w3": (ExpertProjection(inter * size, hidden, size), ShardSlice(0, rank * inter, inter)),
            "w2": (ExpertProjection(hidden, inter * size, size), ShardSlice(1, rank * inter, inter)),
        }
        experts = []
        for e in range(layer.num_experts):
            shards = {}
            for kind, (proj, sl) in slices.items():
                tensors = {name: layer.stash.pop((name, e, kind), None) for name in self.linear.tensor_names}
                lacking = [n for n, t in tensors.items() if t is None]
                if lacking:
                    raise ValueError(f"the checkpoint lacks expert {e}'s {kind} tensor(s) {', '.join(lacking)}")
                shards[kind] = self.linear.take_slice(proj, self.linear.unpack(proj, tensors), sl)
            experts.append(shards)
        layer.stash = {}
        for side in ("w13", "w2"):
            for name in self.linear.tensor_names:
                layer._parameters.pop(f"{side}_{name}", None)
        self.store(layer, experts)

    def store(self, layer: nn.Module, experts: list[dict]) -> None:
        """Per expert its sliced w1 / w3 / w2 shards (the format's logical form) -> the layer's stacked tensors."""
        raise NotImplementedError

    def set_stored(self, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            layer.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))

    def dequantized(self, layer: nn.Module, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The given experts' w13 [e, 2I, H] and w2 [e, H, I] in float32 (the torch reference's weights)."""
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if x.is_cuda:
            return self.apply_cuda(layer, x, topk_weights, topk_ids)
        used = torch.unique(topk_ids)
        remap = torch.zeros(layer.num_experts, dtype=torch.long, device=topk_ids.device)
        remap[used] = torch.arange(used.numel(), device=topk_ids.device)
        w13, w2 = self.dequantized(layer, used)  # float32, as the dense layers' CPU reference multiplies
        return fused_experts_torch(x.float(), w13, w2, topk_weights, remap[topk_ids], layer.act_fn).to(x.dtype)

    def operands(self, layer: nn.Module) -> tuple:
        """The stored experts as the kernel and its reference take them (after x, before the routing)."""
        raise NotImplementedError

    def kernel(self):
        """kernels/fused_moe_quant.py's fused experts of the format."""
        raise NotImplementedError

    def apply_cuda(self, layer: nn.Module, x, topk_weights, topk_ids) -> torch.Tensor:
        return self.kernel()(x, *self.operands(layer), topk_weights, topk_ids, layer.act_fn)

    def draw_dummy(self, layer: nn.Module, std: float, gen: torch.Generator) -> None:
        """load_format="dummy": N(0, std^2) experts quantized into the stored layout."""
        e, inter, hidden = layer.num_experts, layer.local_inter, layer.hidden_size
        w13 = torch.randn(e, 2 * inter, hidden, generator=gen, device=gen.device) * std
        w2 = torch.randn(e, hidden, inter, generator=gen, device=gen.device) * std
        layer.stash = {}
        for side in ("w13", "w2"):
            for name in self.linear.tensor_names:
                layer._parameters.pop(f"{side}_{name}", None)
        self.set_stored(layer, {**self.quantize(layer, "w13", w13), **self.quantize(layer, "w2", w2)})

    def quantize(self, layer: nn.Module, side: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Float experts [E, N, K] -> the stored tensors of one side (dummy weights, benchmarks)."""
        raise NotImplementedError

    def reference(self, layer: nn.Module, x, topk_weights, topk_ids, quantized: bool) -> torch.Tensor:
        """The torch reference of apply_cuda (float32); quantized: with the FP8 activations the kernel quantizes."""
        return self.reference_fn(x, *self.operands(layer), topk_weights, topk_ids, layer.act_fn, quantized)

    @staticmethod
    def reference_fn(*args) -> torch.Tensor:
        raise NotImplementedError


def check_moe_kernels(method: PrequantizedMoEMethod, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The method's fused-MoE kernels against its torch reference on small experts of this device, at decode token
    counts with and without quantized activations and a prefill one, once at start-up (dtype: the activations';
    tests pass float32 under the interpreter)."""
    from novainfer.kernels.fp8_block import WEIGHT_ONLY_MAX_M
    from novainfer.layers.activation import get_act_and_mul
    from novainfer.layers.fused_moe.routing import select_experts
    from novainfer.layers.quantization.prequantized import probe_kernels

    g = torch.Generator(device=device).manual_seed(0)
    layer = nn.Module()
    layer.num_experts, layer.act_dtype, layer.act_fn = 4, dtype, get_act_and_mul("silu")
    hidden, inter = 256, 128
    method.check_sizes(hidden, inter, 1)
    for side, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        w = torch.randn(layer.num_experts, n, k, generator=g, device=device) * 0.05
        method.set_stored(layer, method.quantize(layer, side, w))
    cases = []
    for tokens in (WEIGHT_ONLY_MAX_M, 3, 2 * WEIGHT_ONLY_MAX_M):  # weight-only (one GEMV a pair where it has one)
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(tokens, layer.num_experts, generator=g, device=device), 2, True)
        ref = method.reference(layer, x, weights, ids, tokens > WEIGHT_ONLY_MAX_M)
        cases.append((method.apply_cuda(layer, x, weights, ids), ref))
    probe_kernels(f"{type(method).__name__} (fused MoE)", cases, 2e-2)

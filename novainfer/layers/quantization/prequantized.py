"""What the pre-quantized checkpoint formats share (fp8_block.py, int4.py, compressed_tensors.py): a linear layer
holds the checkpoint's own tensors, under the checkpoint's names (qweight, weight_scale_inv, ...), until every
shard is in; then the format turns each shard into its stored form, takes this rank's tensor-parallel slice and
stacks the fused shards (qkv, gate_up).

The layer's slice is read off its class (linear.py): column-parallel layers take rows (N) of each shard,
row-parallel ones columns (K); the format checks at start-up that its packing and group boundaries divide them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from novainfer.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from novainfer.layers.quantization.base import QuantizeMethodBase


# modules every pre-quantized format keeps in the model's dtype here: the lm_head, the embedding and the MoE routers
# (mlp.gate, Qwen2-MoE's shared_expert_gate: ReplicatedLinear layers, which the formats' tools leave unquantized)
KEPT_DENSE = re.compile(r"(^|\.)(lm_head|embed_tokens|(mlp|block_sparse_moe)\.gate|shared_expert_gate)$")
# names of quantized modules an unquantized-modules pattern must not match
QUANTIZED_PROBES = tuple(
    f"model.layers.0.{m}"
    for m in (
        "self_attn.q_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.down_proj",
        "mlp.experts.0.gate_proj",
        "mlp.experts.0.down_proj",
        "mlp.shared_expert.gate_proj",
        "block_sparse_moe.experts.0.w1",
        "block_sparse_moe.experts.0.w2",
    )
)


def quantized_linear(layer: nn.Module) -> bool:
    """Whether a pre-quantized format's method takes this layer: every linear layer but the replicated ones (MoE
    routers and shared-expert gates, stored unquantized)."""
    return isinstance(layer, LinearBase) and not isinstance(layer, ReplicatedLinear)


def refuse_unquantized_modules(field: str, entries: list[str] | None, method: str) -> None:
    """ValueError naming the field where a checkpoint leaves modules unquantized that we would quantize; entries
    naming only what stays dense anyway (KEPT_DENSE; a `re:` pattern matching no QUANTIZED_PROBES) pass."""
    for entry in entries or []:
        if entry.startswith("re:"):
            pattern = re.compile(entry[3:])
            if not any(pattern.match(name) for name in QUANTIZED_PROBES):
                continue
        elif KEPT_DENSE.search(entry):
            continue
        raise ValueError(
            f"quantization_config.{field} lists {entry!r} ({method}): layers left unquantized (other than the "
            "lm_head, the embedding and the MoE routers) are not supported"
        )


@dataclass(frozen=True)
class ShardSlice:
    """This rank's part of one checkpoint shard in [N, K] terms: dim 0 (rows) or 1 (columns), or None (whole)."""

    dim: int | None
    start: int
    size: int  # this rank's rows (dim 0 or None) or columns (dim 1)


def shard_slices(layer: nn.Module) -> dict[Any, ShardSlice]:
    """Per shard id of the layer (shard_order), the slice of that checkpoint tensor this rank holds."""
    rank = getattr(layer, "tp_rank", 0)
    if isinstance(layer, RowParallelLinear):
        return {None: ShardSlice(1, rank * layer.input_size, layer.input_size)}
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return {"q": ShardSlice(0, rank * q, q), "k": ShardSlice(0, rank * kv, kv), "v": ShardSlice(0, rank * kv, kv)}
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [s // layer.tp_size for s in layer.output_sizes]
        return {i: ShardSlice(0, rank * s, s) for i, s in enumerate(sizes)}
    if isinstance(layer, ColumnParallelLinear):
        return {None: ShardSlice(0, rank * layer.output_size, layer.output_size)}
    return {None: ShardSlice(None, 0, layer.output_size)}


def layer_label(layer: nn.Module) -> str:
    """A layer's class and this rank's [N, K] for start-up errors."""
    return f"{type(layer).__name__} [{layer.output_size}, {layer.input_size}] (tp_size={getattr(layer, 'tp_size', 1)})"


class PrequantizedLinearMethod(QuantizeMethodBase):
    """Collects a layer's checkpoint tensors by name and shard; subclasses say which names and how they combine.

    tensor_names: the per-layer tensor names of the format (`weight` among them where the checkpoint has one;
    its other names become placeholder parameters whose weight_loader stashes what arrives)."""

    tensor_names: tuple[str, ...] = ()

    def check_layer(self, layer: nn.Module) -> None:
        """Raise ValueError, naming the config field, where this rank's slices break the format's boundaries."""

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int) -> nn.Parameter:
        self.check_layer(layer)
        layer.stash = {}
        for name in self.tensor_names:
            if name != "weight":
                param = nn.Parameter(torch.empty(0), requires_grad=False)
                param.weight_loader = partial(self._stash, layer, name)
                layer.register_parameter(name, param)
        if "weight" in self.tensor_names:
            return nn.Parameter(torch.empty(0), requires_grad=False)
        return torch.empty(0)  # not a parameter: the checkpoint has no `weight` for this layer, nor do we ask it

    def _stash(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer.stash[(name, shard_id)] = loaded

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: Any, dense_loader) -> None:
        layer.stash[("weight", shard_id)] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.stash:
            return  # done already, or drawn by draw_dummy
        shards = {}
        for sid, sl in shard_slices(layer).items():
            tensors = {name: t for (name, s), t in layer.stash.items() if s == sid}
            if not tensors:  # e.g. Phi-3's fused qkv_proj, stored quantized as one tensor
                got = sorted({str(s) for _, s in layer.stash})
                raise ValueError(
                    f"{layer_label(layer)}: the checkpoint has no quantized tensors for shard {sid!r} (it has "
                    f"shards {got}); a pre-quantized checkpoint that stores this layer fused is not supported"
                )
            shards[sid] = self.take_slice(layer, self.unpack(layer, tensors), sl)
        layer.stash = {}
        for name in self.tensor_names:  # the placeholders go; the stored form replaces them
            if name != "weight" and name in layer._parameters:
                del layer._parameters[name]
        self.store(layer, [shards[s] for s in shard_slices(layer)])

    def unpack(self, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
        """One shard's checkpoint tensors -> the format's logical form (unsliced)."""
        raise NotImplementedError

    def take_slice(self, layer: nn.Module, shard: Any, sl: ShardSlice) -> Any:
        """This rank's slice of one shard's logical form."""
        raise NotImplementedError

    def store(self, layer: nn.Module, shards: list[Any]) -> None:
        """The fused shards (in shard order) -> the layer's stored tensors."""
        raise NotImplementedError


def probe_kernels(what: str, cases: list[tuple[torch.Tensor, torch.Tensor]], max_rel: float) -> None:
    """Start-up check of a format's GPU kernels on small operands: ValueError naming the format where a kernel's
    result (first of each pair) strays from its torch reference (second) by more than max_rel, or fails to run."""
    for got, want in cases:
        err = ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()
        if not err <= max_rel:
            raise ValueError(f"{what}: the GPU kernels give wrong results on this device (relative error {err:.2e})")

"""Gated DeltaNet (Qwen3.5, Qwen3-Next): linear attention whose per-sequence state is a causal-conv window and a
[v_heads, k_dim, v_dim] matrix, updated token by token by the gated delta rule.

Per token t of a head (q and k L2-normalised, q scaled by k_dim^-1/2):
    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
The layer runs the kernels of kernels/gated_delta_rule.py on the slot pools in place: a decode step as
causal_conv1d_update + fused_recurrent_gated_delta_rule (no host reads: CUDA graphs capture it), a prefill as
causal_conv1d + a chunked rule (fla's chunk_gated_delta_rule when fla-core imports, else ours). On CUDA tensors
these are Triton kernels; on the CPU in float32 the C kernels of kernels/cpu/gated_delta.py (one call per step for
conv and rule), else the torch references. The state lives in slots bound by the
runner (worker/state_cache.py); which slot a sequence owns comes with the step's attention metadata (state_slots).
A sequence whose step starts at position 0 starts from a zero state (the kernels read its slot, which the runner
zeroes first: StateSlotsMetadata.fresh).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.attention.metadata import AttentionMetadata, get_attention_metadata
from novainfer.distributed import get_tp_group, shard_dim
from novainfer.kernels.gated_delta_rule import (
    PackedIndex,
    causal_conv1d_torch,
    causal_conv1d_triton,
    causal_conv1d_update_torch,
    causal_conv1d_update_triton,
    chunk_gated_delta_rule_torch,
    chunk_gated_delta_rule_triton,
    fused_recurrent_gated_delta_rule_torch,
    fused_recurrent_gated_delta_rule_triton,
    packed_index,
)
from novainfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    adjacent_weights,
    dense_linear,
)
from novainfer.kernels.cpu import gated_delta as gated_delta_cpu
from novainfer.kernels.cpu import gdn_layer as gdn_layer_cpu


@dataclass
class StateSlotsMetadata:
    """A step's state slots: each sequence's own, plus the prefix-cache checkpoints it restores or saves.

    restores: sequence index -> checkpoint slot copied into the sequence's slot before its tokens run (a prefix
    cache hit: the state at the hit position). saves: sequence index -> (tokens into its step, checkpoint slot)
    the state after that many of its tokens is copied to. Copies happen per sequence in step order, so a
    sequence may restore a checkpoint an earlier sequence of the same step saves. fresh: the sequences whose step
    starts at position 0; their slots are zeroed before the forward (zero_fresh), as the kernels read them."""

    slots: torch.Tensor  # [num_seqs] int64 on the device
    slots_cpu: list[int]
    restores: dict[int, int] = field(default_factory=dict)
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)
    fresh: list[int] = field(default_factory=list)

    def on(self, device: torch.device) -> "StateSlotsMetadata":
        """This step's metadata with the slot tensor uploaded (asynchronously from pinned memory)."""
        return StateSlotsMetadata(
            self.slots.to(device, non_blocking=True), self.slots_cpu, self.restores, self.saves, self.fresh
        )

    def zero_fresh(self, *pools: torch.Tensor, dim: int = 0) -> None:
        """Zero the fresh sequences' slots (along dim) of each pool; a no-op, and no upload, without any."""
        if self.fresh:
            idx = torch.tensor([self.slots_cpu[i] for i in self.fresh], dtype=torch.long)
            for pool in pools:
                pool.index_fill_(dim, idx.to(pool.device, non_blocking=True), 0)


@dataclass
class Wave:
    """One conv + chunked-rule launch over some sequences' runs of a prefill step, and the state copies around it:
    copies_before (checkpoint -> sequence slot: a restore), copies_after (sequence slot -> checkpoint: a save)."""

    rows: torch.Tensor | None  # the wave's token rows on the device; None: every token of the step, in order
    cu: torch.Tensor  # [runs + 1] int32 on the device
    slots: torch.Tensor  # [runs] int64 on the device
    copies_before: list[tuple[int, int]]
    copies_after: list[tuple[int, int]]
    index: PackedIndex | None = None  # the Triton kernels' token and chunk index, built by the first layer

    def packed_index(self, tokens: int) -> PackedIndex:
        """The wave's PackedIndex, built once for all DeltaNet layers of the step."""
        if self.index is None:
            self.index = packed_index(self.cu, tokens)
        return self.index


def wave_plan(meta: AttentionMetadata, state: StateSlotsMetadata, device: torch.device) -> list[Wave]:
    """A prefill step's waves, the same for every DeltaNet layer: built by the first and kept on the step's state
    metadata. A save at a cut splits its sequence into two runs in consecutive waves, the state copied to the
    checkpoint in between; a restore is copied in before the sequence's first wave, after an earlier sequence of
    the step saves it."""
    plan = state.__dict__.get("wave_plan")
    if plan is not None:
        return plan
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if qsl is None or seq_lens is None:
        qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    runs: dict[int, list[tuple[int, int, int]]] = {}  # sequence -> its (start, end, checkpoint or -1) runs
    for i in range(len(seq_lens)):
        lo, hi = qsl[i], qsl[i + 1]
        if hi > lo:
            cut, ckpt = state.saves.get(i, (hi - lo, -1))
            runs[i] = [(lo, lo + cut, ckpt), (lo + cut, hi, -1)] if 0 < cut < hi - lo else [(lo, hi, ckpt)]
    waiting = {i: state.restores[i] for i in runs if i in state.restores and seq_lens[i] != qsl[i + 1] - qsl[i]}
    saved_later = {ckpt: i for i, (_, ckpt) in state.saves.items()}  # checkpoint -> the sequence saving it
    plan = []
    while runs:
        wave, before = [], []
        for i in list(runs):
            src = waiting.get(i)
            if src is not None:
                if saved_later.get(src, i) < i:
                    continue  # an earlier sequence saves this checkpoint in a later wave
                before.append((src, state.slots_cpu[i]))
                del waiting[i]
            wave.append((i, runs[i].pop(0)))
            if not runs[i]:
                del runs[i]
        if not wave:
            raise RuntimeError("state checkpoint restores wait on each other")
        whole = len(wave) == len(seq_lens) and all(a == qsl[i] and b == qsl[i + 1] for i, (a, b, _) in wave)
        rows = None if whole else torch.cat([torch.arange(a, b) for _, (a, b, _) in wave]).to(device)
        cu = torch.tensor([0] + [b - a for _, (a, b, _) in wave], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        slots = torch.tensor([state.slots_cpu[i] for i, _ in wave], dtype=torch.long)
        after = [(state.slots_cpu[i], ckpt) for i, (_, _, ckpt) in wave if ckpt >= 0]
        for _, ckpt in after:
            saved_later.pop(ckpt, None)
        plan.append(Wave(rows, cu.to(device, non_blocking=True), slots.to(device, non_blocking=True), before, after))
    state.__dict__["wave_plan"] = plan
    return plan


@functools.cache
def fla_chunk_rule() -> Callable | None:
    """fla-core's chunk_gated_delta_rule (the faster prefill on CUDA), or None when fla is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - an optional dependency: any import failure means our chunk kernel
        return None
    return chunk_gated_delta_rule


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, times silu(z): weight * norm(x) * silu(z), the norm taken in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from novainfer.kernels.fused_ops import gated_rms_norm

            return gated_rms_norm(x.contiguous(), z, self.weight, self.eps)
        fused = gated_delta_cpu.gated_rms_norm(x, z, self.weight, self.eps)  # float32 on the CPU: one C call
        if fused is not None:
            return fused
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(dtype)) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of a hybrid layer, with the checkpoint's Qwen3.5 parameter names
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm, out_proj).

    Tensor parallelism splits the heads: each rank holds num_k_heads / tp key heads and the value heads they
    serve (q, k and v channels of in_proj_qkv and of the conv alike), out_proj all-reduces.

    conv_state [slots, kernel - 1, conv_dim] and ssm_state [slots, v_heads, k_dim, v_dim] (float32, or bfloat16
    under mamba_ssm_cache_dtype) are views the runner binds; with no state_slots in the metadata (a profiling
    forward) every sequence starts from zeros and nothing is kept."""

    def __init__(self, config: Any):
        super().__init__()
        num_k_heads, num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={num_v_heads} must be a multiple of linear_num_key_heads={num_k_heads}"
            )
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        for name, heads in (("linear_num_key_heads", num_k_heads), ("linear_num_value_heads", num_v_heads)):
            if heads % self.tp_size:
                raise ValueError(f"{name}={heads} is not divisible by tensor_parallel_size={self.tp_size}")
        self.num_k_heads, self.num_v_heads = num_k_heads // self.tp_size, num_v_heads // self.tp_size
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act={act!r}: the Gated DeltaNet conv runs SiLU only")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        tp = self.tp_size
        # one checkpoint tensor, three column-parallel parts (split by the model: in_proj_q / _k / _v)
        self.in_proj_qkv = MergedColumnParallelLinear(
            hidden, [tp * self.key_dim, tp * self.key_dim, tp * self.value_dim]
        )
        self.in_proj_z = ColumnParallelLinear(hidden, tp * self.value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden, tp * self.num_v_heads)
        self.in_proj_a = ColumnParallelLinear(hidden, tp * self.num_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.dt_bias.weight_loader = self.A_log.weight_loader = self._load_heads
        # unquantized, the four input projections' weights are row ranges of in_proj: one GEMM on the GPU
        self.in_proj = adjacent_weights([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        self.in_proj_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(tp * self.value_dim, hidden)
        self.conv_state = self.ssm_state = torch.tensor([])

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's value heads of a per-head parameter (dt_bias, A_log)."""
        param.data.copy_(shard_dim(loaded, 0, self.tp_rank, self.tp_size, tuple(param.shape)))

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's q, k and v channels of the conv weight, as in_proj_qkv holds them."""
        parts = loaded.split([self.tp_size * self.key_dim, self.tp_size * self.key_dim, self.tp_size * self.value_dim])
        param.data.copy_(
            torch.cat(
                [shard_dim(p, 0, self.tp_rank, self.tp_size, (p.shape[0] // self.tp_size, *p.shape[1:])) for p in parts]
            )
        )

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: the conv window's shape and the recurrent state's shape."""
        return (self.kernel - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        if not isinstance(meta, AttentionMetadata):
            raise NotImplementedError("Gated DeltaNet layers run only with the paged (BLOCK) cache layout")
        step = self.cpu_decode_step(hidden_states)
        if step is not None and (kernel := gdn_layer_cpu.layer_kernel(self)) is not None:
            return kernel.run(hidden_states, *step)  # the mixer in one C call (its weights are packed)
        if self.in_proj is not None and hidden_states.is_cuda:
            mixed, z, b, a = dense_linear(hidden_states, self.in_proj).split(self.in_proj_sizes, dim=-1)
        else:
            mixed, z = self.in_proj_qkv(hidden_states), self.in_proj_z(hidden_states)
            b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        return self.out_proj(self.mix_projected(mixed, z, b, a, meta))

    def mix_projected(
        self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The gated, normed mixer output [tokens, value_dim] (out_proj's input) from the input projections' outputs
        (the batch-1 GPU stack computes those itself)."""
        num_tokens = mixed.shape[0]
        if mixed.is_cuda and self._decode_step(meta):  # the gating inside the recurrence kernel
            out = self._decode(mixed, a, b, meta.state_slots.slots, True, gating=(self.A_log, self.dt_bias))
        else:
            if mixed.is_cuda:
                from novainfer.kernels.fused_ops import gdn_gating

                g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
            else:
                beta = torch.sigmoid(b.float())
                g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
            out = self.mix(mixed, g, beta, meta, use_triton=mixed.is_cuda)
        out = self.norm(out.to(mixed.dtype), z.reshape(num_tokens, self.num_v_heads, self.head_v_dim))
        return out.reshape(num_tokens, self.value_dim)

    def cpu_decode_step(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(slots as int64, continues as uint8) when this step is a plain CPU decode step (one token per sequence,
        float32, no prefix-cache state copies) that kernels/cpu/gdn_layer.py's C call may take, else None. Built
        once a step (kept on the step's state metadata) for all of the model's DeltaNet layers."""
        if hidden_states.is_cuda or hidden_states.dtype is not torch.float32:
            return None
        meta = get_attention_metadata()
        state = getattr(meta, "state_slots", None)
        if not isinstance(meta, AttentionMetadata) or state is None:
            return None
        if meta.max_query_len != 1 or state.restores or state.saves:
            return None
        operands = state.__dict__.get("cpu_decode_operands")
        if operands is None:
            continues = meta.seq_lens[: hidden_states.shape[0]] > 1
            operands = (state.slots.to(torch.int64).contiguous(), continues.to(torch.uint8).contiguous())
            state.__dict__["cpu_decode_operands"] = operands
        return operands

    def mix(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata, use_triton: bool
    ) -> torch.Tensor:
        """The conv and the delta rule of a step's tokens, [T, v_heads, v_dim]: the Triton kernels (on CUDA; tests
        call them on the CPU under TRITON_INTERPRET), else the C kernels or the torch references."""
        state = meta.state_slots
        if not self._decode_step(meta):
            return self._prefill(mixed, g, beta, meta, use_triton)
        if not use_triton and gated_delta_cpu.usable(mixed, self.conv_state, self.ssm_state):
            continues = meta.seq_lens[: mixed.shape[0]] > 1
            return gated_delta_cpu.decode_step(
                mixed,
                self.conv_state,
                self.ssm_state,
                state.slots,
                continues,
                self.conv1d.weight,
                g,
                beta,
                self.num_k_heads,
                self.head_k_dim,
            )
        return self._decode(mixed, g, beta, state.slots, use_triton)

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the conv output [T, conv_dim] as the kernels take them: q, k [T, k_heads, k_dim], v."""
        n = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.view(n, self.num_k_heads, self.head_k_dim),
            k.view(n, self.num_k_heads, self.head_k_dim),
            v.view(n, self.num_v_heads, self.head_v_dim),
        )

    @staticmethod
    def _decode_step(meta: AttentionMetadata) -> bool:
        """Whether the step is one token per sequence with no prefix-cache state copies (the decode kernels')."""
        state = meta.state_slots
        return meta.max_query_len == 1 and state is not None and not state.restores and not state.saves

    def _decode(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        slots: torch.Tensor,
        use_triton: bool,
        gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One token per sequence on the slot pools in place (a fresh sequence's slot was zeroed; a negative slot is
        a graph's padding row); nothing here reads the device, so a CUDA graph captures it. gating (Triton only):
        g and beta are raw a and b, gated in the recurrence kernel."""
        conv_update = causal_conv1d_update_triton if use_triton else causal_conv1d_update_torch
        conv = conv_update(mixed, self.conv1d.weight[:, 0], None, self.conv_state, slots)
        if use_triton:
            return fused_recurrent_gated_delta_rule_triton(
                *self._split(conv), g, beta, self.ssm_state, slots, gating=gating
            )
        return fused_recurrent_gated_delta_rule_torch(*self._split(conv), g, beta, self.ssm_state, slots)

    def _chunk_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
        cu: torch.Tensor,
        index: PackedIndex | None = None,
    ) -> torch.Tensor:
        """The chunked delta rule over packed sequences from and back into pool[slots]: fla's on CUDA when it
        imports (its states gathered and scattered), else ours in place; ours in float32 (fla's matmuls are TF32)."""
        fla = fla_chunk_rule() if q.is_cuda and q.dtype != torch.float32 else None
        if fla is None:
            return chunk_gated_delta_rule_triton(q, k, v, g, beta, pool, slots, cu, index=index)
        # q and k normalised here, not by fla: its L2-norm kernel autotunes again for every bucket of token counts
        from novainfer.kernels.fused_ops import l2_norm_heads_

        qk = q.as_strided((q.shape[0], 2 * self.key_dim), (q.stride(0), 1))  # q then k, adjacent in the conv output
        l2_norm_heads_(qk, 2 * self.num_k_heads, self.head_k_dim)
        o, final = fla(
            q[None],
            k[None],
            v[None],
            g=g[None],
            beta=beta.to(q.dtype)[None],
            initial_state=pool[slots].float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=cu.long(),
        )
        pool[slots] = final.to(pool.dtype)
        return o[0]

    def _run(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        slots: torch.Tensor,
        cu: torch.Tensor,
        use_triton: bool,
        index: PackedIndex | None = None,
    ) -> torch.Tensor:
        """Conv and chunked rule over packed runs of tokens, each from and back into its slot of the pools (index:
        the Triton kernels' PackedIndex of cu)."""
        if use_triton:
            conv = causal_conv1d_triton(x, self.conv1d.weight[:, 0], None, conv_pool, slots, cu, index=index)
            return self._chunk_rule(*self._split(conv), g, beta, ssm_pool, slots, cu, index)
        if gated_delta_cpu.usable(x, conv_pool, ssm_pool):
            return gated_delta_cpu.prefill(
                x, conv_pool, ssm_pool, slots, cu, self.conv1d.weight, g, beta, self.num_k_heads, self.head_k_dim
            )
        conv = causal_conv1d_torch(x, self.conv1d.weight[:, 0], None, conv_pool, slots, cu)
        return chunk_gated_delta_rule_torch(*self._split(conv), g, beta, ssm_pool, slots, cu)

    def _prefill(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata, use_triton: bool
    ) -> torch.Tensor:
        """All sequences' runs batched into one conv and one chunked-rule launch per wave (wave_plan), the
        checkpoint copies between waves."""
        state, dev = meta.state_slots, mixed.device
        if state is None:  # a profiling forward: every sequence from zeros, into scratch slots
            n = meta.seq_lens.numel() if meta.seq_lens_cpu is None else len(meta.seq_lens_cpu)
            state = StateSlotsMetadata(torch.arange(n, device=dev), list(range(n)))
            conv_pool = torch.zeros(n, *self.state_shapes()[0], dtype=mixed.dtype, device=dev)
            ssm_pool = torch.zeros(n, *self.state_shapes()[1], dtype=torch.float32, device=dev)
        else:
            conv_pool, ssm_pool = self.conv_state, self.ssm_state
        out = None
        for wave in wave_plan(meta, state, dev):
            for src, dst in wave.copies_before:
                self._copy_state(src, dst)
            idx = wave.rows
            x, gw, bw = (mixed, g, beta) if idx is None else (mixed[idx], g[idx], beta[idx])
            index = wave.packed_index(x.shape[0]) if use_triton else None
            o = self._run(x, gw, bw, conv_pool, ssm_pool, wave.slots, wave.cu, use_triton, index)
            if idx is None:
                out = o
            else:
                if out is None:
                    out = torch.empty(mixed.shape[0], *o.shape[1:], dtype=o.dtype, device=dev)
                out[idx] = o
            for src, dst in wave.copies_after:
                self._copy_state(src, dst)
        if out is None:  # no tokens
            out = torch.empty(0, self.num_v_heads, self.head_v_dim, dtype=mixed.dtype, device=dev)
        return out

    def _copy_state(self, src: int, dst: int) -> None:
        """Slot dst takes slot src's conv window and recurrent state (a checkpoint restored)."""
        self.conv_state[dst] = self.conv_state[src]
        self.ssm_state[dst] = self.ssm_state[src]

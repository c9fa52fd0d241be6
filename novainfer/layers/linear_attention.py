"""Gated DeltaNet (Qwen3.5, Qwen3-Next): linear attention whose per-sequence state is a causal-conv window and a
[v_heads, k_dim, v_dim] matrix, updated token by token by the gated delta rule.

Per token t of a head (q and k L2-normalised, q scaled by k_dim^-1/2):
    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
On CUDA tensors the layer runs the Triton kernels of kernels/gated_delta_rule.py on the slot pools in place: a
decode step as causal_conv1d_update + fused_recurrent_gated_delta_rule (no host reads: CUDA graphs capture it), a
prefill as causal_conv1d + a chunked rule (fla's chunk_gated_delta_rule when fla-core imports, else ours). Elsewhere
the pure-torch reference here runs: a prefill (or prefill chunk) in chunks of CHUNK tokens solved as one triangular
system per chunk, a decode step as the recurrence batched over sequences. The state lives in slots bound by the
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
    causal_conv1d_triton,
    causal_conv1d_update_triton,
    chunk_gated_delta_rule_triton,
    fused_recurrent_gated_delta_rule_triton,
)
from novainfer.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from novainfer.kernels.cpu import gated_delta as gated_delta_cpu

CHUNK = 64  # tokens per chunk of the chunked prefill form


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


@functools.cache
def fla_chunk_rule() -> Callable | None:
    """fla-core's chunk_gated_delta_rule (the faster prefill on CUDA), or None when fla is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - an optional dependency: any import failure means our chunk kernel
        return None
    return chunk_gated_delta_rule


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA convention transformers follows)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's delta rule over L tokens, chunk by chunk, in float32.

    q, k: [L, H, Dk] (normalised and scaled already), v: [L, H, Dv], g, beta: [L, H], state: [H, Dk, Dv].
    Returns (out [L, H, Dv], final state). Within a chunk with cumulative log-decay G, the new values u
    solve (I + A) u = beta v - beta exp(G) K S0 with A[t, j] = beta_t exp(G_t - G_j) k_t.k_j for j < t."""
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, L, D]
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [H, L]
    length = q.shape[1]
    out = torch.empty_like(v)
    s = state.float()
    for c0 in range(0, length, chunk):
        c1 = min(c0 + chunk, length)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        cum = g[:, c0:c1].cumsum(-1)  # [H, C]
        n = c1 - c0
        diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [H, C, C]: G_t - G_j
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        kk = kc @ kc.transpose(-1, -2)
        a = (bc.unsqueeze(-1) * kk * decay).tril(-1)
        eye = torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc.unsqueeze(-1) * (vc - (cum.exp().unsqueeze(-1) * kc) @ s)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)  # [H, C, Dv]
        out[:, c0:c1] = cum.exp().unsqueeze(-1) * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[:, -1:]  # [H, 1]
        s = last.exp().unsqueeze(-1) * s + ((last - cum).exp().unsqueeze(-1) * kc).transpose(-1, -2) @ u
    return out.transpose(0, 1), s


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] (float32).
    Returns (out [B, H, Dv], new state)."""
    s = state * g.float().exp()[..., None, None]
    kf, vf = k.float(), v.float()
    u = beta.float().unsqueeze(-1) * (vf - (s * kf.unsqueeze(-1)).sum(-2))
    s = s + kf.unsqueeze(-1) * u.unsqueeze(-2)
    return (s * q.float().unsqueeze(-1)).sum(-2), s


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, times silu(z): weight * norm(x) * silu(z), the norm taken in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from novainfer.kernels.fused_ops import gated_rms_norm

            return gated_rms_norm(x.contiguous(), z.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(dtype)) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of a hybrid layer, with the checkpoint's Qwen3.5 parameter names
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm, out_proj).

    Tensor parallelism splits the heads: each rank holds num_k_heads / tp key heads and the value heads they
    serve (q, k and v channels of in_proj_qkv and of the conv alike), out_proj all-reduces.

    conv_state [slots, kernel - 1, conv_dim] and ssm_state [slots, v_heads, k_dim, v_dim] (float32) are views
    the runner binds; with no state_slots in the metadata (a profiling forward) every sequence starts from
    zeros and nothing is kept."""

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
        num_tokens = hidden_states.shape[0]
        mixed = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).view(num_tokens, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        if hidden_states.is_cuda:
            from novainfer.kernels.fused_ops import gdn_gating

            g, beta = gdn_gating(a.contiguous(), b.contiguous(), self.A_log, self.dt_bias)
        else:
            beta = torch.sigmoid(b.float())
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self.mix(mixed, g, beta, meta, use_triton=hidden_states.is_cuda)
        out = self.norm(out.to(hidden_states.dtype), z)
        return self.out_proj(out.reshape(num_tokens, self.value_dim))

    def mix(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata, use_triton: bool
    ) -> torch.Tensor:
        """The conv and the delta rule of a step's tokens, [T, v_heads, v_dim]: the Triton kernels (on CUDA; tests
        call them on the CPU under TRITON_INTERPRET) or the torch reference."""
        state = meta.state_slots
        decode = meta.max_query_len == 1 and state is not None and not state.restores and not state.saves
        if use_triton:
            return (
                self._decode_kernels(mixed, g, beta, state.slots)
                if decode
                else self._prefill_kernels(mixed, g, beta, meta)
            )
        if decode:
            return self._decode(mixed, g, beta, state.slots, meta.seq_lens[: mixed.shape[0]] > 1)
        return self._prefill(mixed, g, beta, meta)

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the conv output [T, conv_dim] as the kernels take them: q, k [T, k_heads, k_dim], v."""
        n = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.view(n, self.num_k_heads, self.head_k_dim),
            k.view(n, self.num_k_heads, self.head_k_dim),
            v.view(n, self.num_v_heads, self.head_v_dim),
        )

    def _decode_kernels(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One token per sequence on the slot pools in place (a fresh sequence's slot was zeroed; a negative slot is
        a graph's padding row); nothing here reads the device, so a CUDA graph captures it."""
        conv = causal_conv1d_update_triton(mixed, self.conv1d.weight[:, 0], None, self.conv_state, slots)
        return fused_recurrent_gated_delta_rule_triton(*self._split(conv), g, beta, self.ssm_state, slots)

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
    ) -> torch.Tensor:
        """The chunked delta rule over packed sequences from and back into pool[slots]: fla's on CUDA when it
        imports (its states gathered and scattered), else ours in place; ours in float32 (fla's matmuls are TF32)."""
        fla = fla_chunk_rule() if q.is_cuda and q.dtype != torch.float32 else None
        if fla is None:
            return chunk_gated_delta_rule_triton(q, k, v, g, beta, pool, slots, cu)
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
            initial_state=pool[slots],
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=cu.long(),
        )
        pool[slots] = final
        return o[0]

    def _prefill_kernels(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """All sequences' runs batched into one conv and one chunked-rule launch per wave. A save at a cut splits
        its sequence into two runs in consecutive waves, the state copied to the checkpoint in between; a restore
        is copied in before the sequence's first wave, after an earlier sequence of the step saves it."""
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if qsl is None or seq_lens is None:
            qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        state, dev = meta.state_slots, mixed.device
        if state is None:  # a profiling forward: every sequence from zeros, into scratch slots
            state = StateSlotsMetadata(torch.arange(len(seq_lens), device=dev), list(range(len(seq_lens))))
            conv_pool = torch.zeros(len(seq_lens), *self.state_shapes()[0], dtype=mixed.dtype, device=dev)
            ssm_pool = torch.zeros(len(seq_lens), *self.state_shapes()[1], dtype=torch.float32, device=dev)
        else:
            conv_pool, ssm_pool = self.conv_state, self.ssm_state
        runs: dict[int, list[tuple[int, int, int]]] = {}  # sequence -> its (start, end, checkpoint or -1) runs
        for i in range(len(seq_lens)):
            lo, hi = qsl[i], qsl[i + 1]
            if hi > lo:
                cut, ckpt = state.saves.get(i, (hi - lo, -1))
                runs[i] = [(lo, lo + cut, ckpt), (lo + cut, hi, -1)] if 0 < cut < hi - lo else [(lo, hi, ckpt)]
        waiting = {i: state.restores[i] for i in runs if i in state.restores and seq_lens[i] != qsl[i + 1] - qsl[i]}
        saved_later = {ckpt: i for i, (_, ckpt) in state.saves.items()}  # checkpoint -> the sequence saving it
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.head_v_dim, dtype=mixed.dtype, device=dev)
        while runs:
            wave = []
            for i in list(runs):
                src = waiting.get(i)
                if src is not None:
                    if saved_later.get(src, i) < i:
                        continue  # an earlier sequence saves this checkpoint in a later wave
                    self._copy_state(src, state.slots_cpu[i])
                    del waiting[i]
                wave.append((i, runs[i].pop(0)))
                if not runs[i]:
                    del runs[i]
            if not wave:
                raise RuntimeError("state checkpoint restores wait on each other")
            whole = len(wave) == len(seq_lens) and all(a == qsl[i] and b == qsl[i + 1] for i, (a, b, _) in wave)
            idx = None if whole else torch.cat([torch.arange(a, b) for _, (a, b, _) in wave]).to(dev)
            x, gw, bw = (mixed, g, beta) if idx is None else (mixed[idx], g[idx], beta[idx])
            cu = torch.tensor([0] + [b - a for _, (a, b, _) in wave], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            cu = cu.to(dev, non_blocking=True)
            slots = torch.tensor([state.slots_cpu[i] for i, _ in wave], dtype=torch.long).to(dev, non_blocking=True)
            conv = causal_conv1d_triton(x, self.conv1d.weight[:, 0], None, conv_pool, slots, cu)
            o = self._chunk_rule(*self._split(conv), gw, bw, ssm_pool, slots, cu)
            if idx is None:
                out = o
            else:
                out[idx] = o
            for i, (_, _, ckpt) in wave:
                if ckpt >= 0:
                    self._copy_state(state.slots_cpu[i], ckpt)
                    saved_later.pop(ckpt, None)
        return out

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the conv output [T, conv_dim] into q, k (normalised, q scaled, repeated to v heads) and v."""
        n = conv_out.shape[0]
        q, k, v = conv_out.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.view(n, self.num_k_heads, self.head_k_dim)) * self.head_k_dim**-0.5
        k = l2_normalize(k.view(n, self.num_k_heads, self.head_k_dim))
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return q, k, v.view(n, self.num_v_heads, self.head_v_dim)

    def _decode(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, continues: torch.Tensor
    ) -> torch.Tensor:
        """One token per sequence: a decode continues its slot's state, a one-token prompt (continues False)
        starts from zeros. On the CPU in float32, one C call (kernels/cpu/gated_delta.py)."""
        if gated_delta_cpu.usable(mixed, self.conv_state, self.ssm_state):
            return gated_delta_cpu.decode_step(
                mixed,
                self.conv_state,
                self.ssm_state,
                slots,
                continues,
                self.conv1d.weight,
                g,
                beta,
                self.num_k_heads,
                self.head_k_dim,
            )
        weight = self.conv1d.weight[:, 0]  # [C, K]
        prev = torch.where(continues[:, None, None], self.conv_state[slots].transpose(1, 2), 0)
        window = torch.cat([prev, mixed.unsqueeze(-1).to(self.conv_state.dtype)], dim=-1)
        self.conv_state[slots] = window[..., 1:].transpose(1, 2)
        conv = F.silu((window.float() * weight.float()).sum(-1))  # [B, C]
        q, k, v = self._qkv(conv.to(mixed.dtype))
        ssm = torch.where(continues[:, None, None, None], self.ssm_state[slots], 0)
        out, new_state = gated_delta_step(q, k, v, g, beta, ssm)
        self.ssm_state[slots] = new_state
        return out

    def _prefill(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Sequence by sequence: the conv over the slot's window plus this step's tokens, then the chunked rule."""
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if qsl is None or seq_lens is None:
            qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        state = meta.state_slots
        slots = state.slots_cpu if state is not None else None
        weight = self.conv1d.weight.float()
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=mixed.device)
        for i in range(len(seq_lens)):
            lo, hi = qsl[i], qsl[i + 1]
            if hi == lo:
                continue
            fresh = slots is None or seq_lens[i] == hi - lo  # the step starts the sequence at position 0
            if not fresh and i in state.restores:
                self._copy_state(state.restores[i], slots[i])
            x = mixed[lo:hi].t().float()  # [C, L]
            if fresh:
                prev = torch.zeros(self.kernel - 1, self.conv_dim, dtype=torch.float32, device=x.device).t()
                s = torch.zeros(self.state_shapes()[1], dtype=torch.float32, device=x.device)
            else:
                prev, s = self.conv_state[slots[i]].t().float(), self.ssm_state[slots[i]]
            window = torch.cat([prev, x], dim=-1)  # [C, K - 1 + L]
            conv = F.silu(F.conv1d(window.unsqueeze(0), weight, groups=self.conv_dim)[0])  # [C, L]
            q, k, v = self._qkv(conv.t().to(mixed.dtype))
            cut, ckpt = state.saves.get(i, (hi - lo, -1)) if slots is not None else (hi - lo, -1)
            parts = [(0, cut, ckpt), (cut, hi - lo, -1)] if 0 < cut < hi - lo else [(0, hi - lo, ckpt)]
            for a, b, save_to in parts:  # split at a checkpoint to save the state there
                o, s = gated_delta_chunked(q[a:b], k[a:b], v[a:b], g[lo + a : lo + b], beta[lo + a : lo + b], s)
                out[lo + a : lo + b] = o
                if save_to >= 0:
                    self.conv_state[save_to] = window[:, b : b + self.kernel - 1].t().to(self.conv_state.dtype)
                    self.ssm_state[save_to] = s
            if slots is not None:
                self.conv_state[slots[i]] = window[:, -(self.kernel - 1) :].t().to(self.conv_state.dtype)
                self.ssm_state[slots[i]] = s
        return out

    def _copy_state(self, src: int, dst: int) -> None:
        """Slot dst takes slot src's conv window and recurrent state (a checkpoint restored)."""
        self.conv_state[dst] = self.conv_state[src]
        self.ssm_state[dst] = self.ssm_state[src]

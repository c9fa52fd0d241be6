"""Gated DeltaNet kernels for the linear-attention layers of Qwen3-Next / Qwen3.5, with a torch reference beside each.

The recurrence, per value head (S: the [K, V] state, fp32):
    S = exp(g_t) * S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (q_t * K**-0.5)
with q and k L2-normalised. Three pieces:
  * fused_recurrent_gated_delta_rule: one token after the other (decode; also a simple prefill);
  * chunk_gated_delta_rule: prefill in chunks of 64 tokens (the WY form: the chunk's 64 rank-1 updates become a few
    matmuls through the inverse of a unit lower-triangular 64x64 system, then one sequential scan over chunks);
  * causal_conv1d / causal_conv1d_update: the depthwise causal conv (width 4) + SiLU in front of q, k and v.

Shapes: tokens are packed ([T, ...], sequences delimited by cu_seqlens [N+1], int32). q, k: [T, H_k, K];
v: [T, H_v, V] with H_v = H_k * r (value head h reads key head h // r); g (log decay, <= 0) and beta: [T, H_v].
States live in pools indexed by a per-sequence slot: state [num_slots, H_v, K, V] (fp32, or bf16 for half the
bytes: every update still runs in fp32, the result rounded once per step as it is stored) and
conv_state [num_slots, W - 1, D] (the sequence's last W - 1 conv inputs, oldest first, in x's dtype); both are
read and updated in place. A fresh sequence's slot must hold zeros. In decode (fused_recurrent_gated_delta_rule
without cu_seqlens, causal_conv1d_update) a negative slot marks a padding row (batches padded for CUDA graphs): it
reads a zero state and writes none.

Each public function runs the Triton kernel on CUDA tensors and the torch reference otherwise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from novainfer.kernels.fused_ops import gdn_gate
from novainfer.kernels.tiling import launch_or_fallback, sm_count

CHUNK = 64
L2_EPS = 1e-6  # x * rsqrt(sum(x^2) + eps), as transformers' and fla's l2norm
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence (the torch references loop over sequences on the host)."""
    return list(itertools.pairwise(cu_seqlens.tolist()))


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> None:
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != tokens or hv % hk:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q = k = [T, H_k, K], "
            "v [T, H_v, V] with H_v a multiple of H_k"
        )
    if g.shape != (tokens, hv) or beta.shape != (tokens, hv):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [T, H_v] = [{tokens}, {hv}]")
    if state.shape[1:] != (hv, dk, dv) or state.dtype not in STATE_DTYPES or not state.is_contiguous():
        raise ValueError(
            f"state {tuple(state.shape)} {state.dtype}: need a contiguous [num_slots, {hv}, {dk}, {dv}] "
            "float32 or bfloat16 pool (it is updated in place)"
        )


# ----------------------------------------------------------------------------------------------------------------
# torch references (the CPU path)
# ----------------------------------------------------------------------------------------------------------------


def _prep_qk(
    q: torch.Tensor, k: torch.Tensor, groups: int, l2norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in fp32, L2-normalised if asked, q scaled, each key head repeated for its value heads: [T, H_v, K]."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return (q * scale).repeat_interleave(groups, 1), k.repeat_interleave(groups, 1)


def _recurrent_step(
    h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch: h [B, H, K, V], q/k [B, H, K], v [B, H, V], g/beta [B, H]."""
    h = h * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", h, k)) * beta[..., None]
    h = h + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", h, q), h


def _gather_states(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The slots' states (zeros for padding slots), as a new tensor in float32 (a bf16 pool's states widened)."""
    valid = (slots >= 0).view(-1, *([1] * (state.dim() - 1)))
    return state[slots.clamp(min=0).long()].float() * valid


def fused_recurrent_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Torch reference of fused_recurrent_gated_delta_rule (token by token; decode batches in one step)."""
    _check_shapes(q, k, v, g, beta, state)
    groups, dk = v.shape[1] // k.shape[1], k.shape[2]
    qf, kf = _prep_qk(q, k, groups, use_qk_l2norm, dk**-0.5 if scale is None else scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if cu_seqlens is None:  # one token per sequence: the whole batch in one step
        o, h = _recurrent_step(_gather_states(state, slots), qf, kf, vf, gf, bf)
        valid = slots >= 0
        state[slots[valid].long()] = h[valid].to(state.dtype)
        return o.to(q.dtype)
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for n, (s, e) in enumerate(_bounds(cu_seqlens)):
        h = _gather_states(state, slots[n : n + 1])
        for t in range(s, e):
            out, h = _recurrent_step(h, qf[t : t + 1], kf[t : t + 1], vf[t : t + 1], gf[t : t + 1], bf[t : t + 1])
            o[t] = out[0]
        if slots[n] >= 0:
            state[int(slots[n])] = h[0]
    return o.to(q.dtype)


def _chunk_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk in the WY form, heads first: q/k [H, C, K], v [H, C, V], g/beta [H, C], h [H, K, V] -> (o, h)."""
    c = q.shape[1]
    gc = g.cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    eye = torch.eye(c, device=q.device)
    # L = I + strictly_lower(beta_i k_i.k_j decay_ij); its inverse turns the chunk's updates into u and w
    lower = eye + (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).tril(-1)
    u = torch.linalg.solve_triangular(lower, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, (beta * gc.exp())[..., None] * k, upper=False, unitriangular=True)
    v_new = u - w @ h
    o = (q * gc.exp()[..., None]) @ h + ((q @ k.transpose(1, 2)) * decay) @ v_new
    last = gc[:, -1]
    h = h * last.exp()[:, None, None] + (k * (last[:, None] - gc).exp()[..., None]).transpose(1, 2) @ v_new
    return o, h


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Torch reference of chunk_gated_delta_rule: each sequence in chunks of 64 tokens."""
    _check_shapes(q, k, v, g, beta, state)
    groups, dk = v.shape[1] // k.shape[1], k.shape[2]
    qf, kf = _prep_qk(q, k, groups, use_qk_l2norm, dk**-0.5 if scale is None else scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for n, (s, e) in enumerate(_bounds(cu_seqlens)):
        h = state[int(slots[n])].float()
        for c0 in range(s, e, CHUNK):
            c1 = min(c0 + CHUNK, e)
            out, h = _chunk_step(*(x[c0:c1].transpose(0, 1) for x in (qf, kf, vf, gf, bf)), h)
            o[c0:c1] = out.transpose(0, 1)
        state[int(slots[n])] = h
    return o.to(q.dtype)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(x) if activation == "silu" else x


def _check_activation(activation: str | None) -> None:
    if activation not in ("silu", None):
        raise ValueError(f"conv1d activation {activation!r} is not supported (only 'silu' or None)")


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Torch reference of causal_conv1d: each sequence continues from its slot's conv state."""
    _check_activation(activation)
    width = weight.shape[1]
    out = torch.empty_like(x)
    for n, (s, e) in enumerate(_bounds(cu_seqlens)):
        slot = int(slots[n])
        seq = torch.cat([conv_state[slot].to(x.dtype), x[s:e]])  # [W - 1 + L, D]
        y = F.conv1d(
            seq.t().float()[None], weight.float()[:, None], None if bias is None else bias.float(), groups=x.shape[1]
        )[0].t()
        out[s:e] = _activate(y, activation).to(x.dtype)
        conv_state[slot] = seq[seq.shape[0] - (width - 1) :]
    return out


def causal_conv1d_update_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Torch reference of causal_conv1d_update: one token per sequence."""
    _check_activation(activation)
    window = torch.cat([_gather_states(conv_state, slots).to(x.dtype), x[:, None]], 1)  # [N, W, D]
    y = torch.einsum("nwd,dw->nd", window.float(), weight.float())
    if bias is not None:
        y = y + bias.float()
    valid = slots >= 0
    conv_state[slots[valid].long()] = window[valid, 1:].to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels (the CUDA path)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_qk(ptr, rows, row_mask, stride, head, offs_k, K: tl.constexpr, L2NORM: tl.constexpr, eps):
    """Rows of one key head as fp32 [rows, BK], L2-normalised if asked."""
    x = tl.load(
        ptr + rows[:, None] * stride + head * K + offs_k[None, :],
        mask=row_mask[:, None] & (offs_k < K)[None, :],
        other=0.0,
    ).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + eps)[:, None]
    return x


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    a_log_ptr,
    dt_bias_ptr,
    scale,
    eps,
    stride_q,
    stride_k,
    stride_v,
    stride_g,
    stride_b,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    VARLEN: tl.constexpr,
    L2NORM: tl.constexpr,
    RAW_GATES: tl.constexpr,
):
    pid = tl.program_id(0)
    n, hv = pid // HV, pid % HV
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_kv = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    slot = tl.load(slots_ptr + n).to(tl.int64)
    valid = (offs_v * 0 + slot >= 0)[None, :]  # a vector: the interpreter refuses masks from a scalar condition
    if VARLEN:
        start = tl.load(cu_ptr + n).to(tl.int64)
        end = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        start = n.to(tl.int64)
        end = start + 1
    s_ptrs = state_ptr + (tl.maximum(slot, 0) * HV + hv) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    h = tl.load(s_ptrs, mask=mask_kv & valid, other=0.0).to(tl.float32)
    for t in range(start, end):
        rows = t + tl.zeros([1], tl.int64)
        one = rows < end
        qt = tl.reshape(_load_qk(q_ptr, rows, one, stride_q, hk, offs_k, K, L2NORM, eps), [BK]) * scale
        kt = tl.reshape(_load_qk(k_ptr, rows, one, stride_k, hk, offs_k, K, L2NORM, eps), [BK])
        vt = tl.load(v_ptr + t * stride_v + hv * V + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + t * stride_g + hv).to(tl.float32)
        bt = tl.load(beta_ptr + t * stride_b + hv).to(tl.float32)
        if RAW_GATES:  # gt, bt are a and b: the gating kernel's ops
            gt, bt = gdn_gate(gt, bt, tl.load(a_log_ptr + hv), tl.load(dt_bias_ptr + hv))
        h = h * tl.exp(gt)
        delta = (vt - tl.sum(h * kt[:, None], 0)) * bt
        h = h + kt[:, None] * delta[None, :]
        out = tl.sum(h * qt[:, None], 0)
        tl.store(o_ptr + (t * HV + hv) * V + offs_v, out.to(o_ptr.dtype.element_ty), mask=offs_v < V)
    tl.store(s_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask_kv & valid)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with each token's row contiguous, so a kernel needs only the token stride."""
    return x if x.shape[0] == 0 or x[0].is_contiguous() else x.contiguous()


def fused_recurrent_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton fused_recurrent_gated_delta_rule: a program per (sequence, value head, V block) keeps S in registers.
    gating (A_log, dt_bias): g and beta are the input projection's raw a and b, gated in the kernel as
    fused_ops.gdn_gating would (the same float32 ops), which saves that kernel's launch a layer."""
    _check_shapes(q, k, v, g, beta, state)
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    o = torch.empty(tokens, hv, dv, dtype=q.dtype, device=q.device)
    seqs = tokens if cu_seqlens is None else cu_seqlens.numel() - 1
    if seqs == 0 or tokens == 0:
        return o
    # 64-wide V blocks where they still fill the GPU twice over: 13% faster on a float32 pool and 26% on a bf16
    # one than 32 at batch 256 on an H200 (tests/gpu/gdn_check.py's tile rows); 32 keeps small batches parallel
    sms = sm_count(q.device)
    bv = min(triton.next_power_of_2(dv), 64 if seqs * hv * triton.cdiv(dv, 64) >= 2 * sms else 32)
    _recurrent_kernel[(seqs * hv, triton.cdiv(dv, bv))](
        q,
        k,
        v,
        g,
        beta,
        o,
        state,
        slots,
        slots if cu_seqlens is None else cu_seqlens,
        *(gating if gating is not None else (g, g)),
        dk**-0.5 if scale is None else scale,
        L2_EPS,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        g.stride(0),
        beta.stride(0),
        HK=hk,
        HV=hv,
        K=dk,
        V=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        VARLEN=cu_seqlens is not None,
        L2NORM=use_qk_l2norm,
        RAW_GATES=gating is not None,
        num_warps=4 if dk * bv >= 4096 else 2,
    )
    return o


@triton.jit
def _chunk_prepare_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    w_ptr,
    u_ptr,
    gc_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    eps,
    stride_k,
    stride_v,
    stride_g,
    stride_b,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    LOG_C: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
):
    """Per (chunk, value head): the decay's in-chunk cumsum gc, and the WY pair u = L^-1 (beta v),
    w = L^-1 (beta exp(gc) k) with L = I + strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))."""
    c, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // (HV // HK)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    if start < end:
        i = tl.arange(0, C)
        rows = start + i
        live = rows < end
        offs_k = tl.arange(0, BK)
        offs_v = tl.arange(0, BV)
        k = _load_qk(k_ptr, rows, live, stride_k, hk, offs_k, K, L2NORM, eps)
        beta = tl.load(beta_ptr + rows * stride_b + hv, mask=live, other=0.0).to(tl.float32)
        gc = tl.cumsum(tl.load(g_ptr + rows * stride_g + hv, mask=live, other=0.0).to(tl.float32), 0)
        strictly_lower = i[:, None] > i[None, :]
        decay = tl.exp(tl.where(strictly_lower, gc[:, None] - gc[None, :], float("-inf")))
        a = tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay * beta[:, None]
        # L^-1 by recursive doubling: with T the inverse of L's diagonal blocks of size s, the blocks of size 2s are
        # [[T0, 0], [-T1 A10 T0, T1]] = T - T A_off T, A_off holding only the A10 blocks; all matmuls, no row loop
        inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
        for level in tl.static_range(LOG_C):
            a_off = tl.where(
                (i[:, None] >> (level + 1) == i[None, :] >> (level + 1)) & (i[:, None] >> level != i[None, :] >> level),
                a,
                0.0,
            )
            inv -= tl.dot(tl.dot(inv, a_off, input_precision=INV_PRECISION), inv, input_precision=INV_PRECISION)
        v = tl.load(
            v_ptr + rows[:, None] * stride_v + hv * V + offs_v[None, :],
            mask=live[:, None] & (offs_v < V)[None, :],
            other=0.0,
        ).to(tl.float32)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
        w = tl.dot(inv, k * (beta * tl.exp(gc))[:, None], input_precision=PRECISION)
        tl.store(u_ptr + (rows[:, None] * HV + hv) * V + offs_v[None, :], u, mask=live[:, None] & (offs_v < V)[None, :])
        tl.store(w_ptr + (rows[:, None] * HV + hv) * K + offs_k[None, :], w, mask=live[:, None] & (offs_k < K)[None, :])
        tl.store(gc_ptr + rows * HV + hv, gc, mask=live)


@triton.jit
def _chunk_scan_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    u_ptr,
    gc_ptr,
    o_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    scale,
    eps,
    stride_q,
    stride_k,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per (sequence, value head, V block): the scan over chunks. With v' = u - w S, a chunk's output is
    (q exp(gc)) S + (q k^T * causal decay) v' and the state becomes exp(gc_last) S + (k exp(gc_last - gc))^T v'."""
    n, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_kv = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    slot = tl.load(slots_ptr + n).to(tl.int64)
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    s_ptrs = state_ptr + (slot * HV + hv) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    h = tl.load(s_ptrs, mask=mask_kv, other=0.0).to(tl.float32)
    i = tl.arange(0, C)
    causal = i[:, None] >= i[None, :]
    for c0 in range(start, end, C):
        rows = c0 + i
        live = rows < end
        q = _load_qk(q_ptr, rows, live, stride_q, hk, offs_k, K, L2NORM, eps) * scale
        k = _load_qk(k_ptr, rows, live, stride_k, hk, offs_k, K, L2NORM, eps)
        gc = tl.load(gc_ptr + rows * HV + hv, mask=live, other=0.0)
        last = tl.sum(tl.where(rows == tl.minimum(c0 + C, end) - 1, gc, 0.0), 0)
        w = tl.load(
            w_ptr + (rows[:, None] * HV + hv) * K + offs_k[None, :],
            mask=live[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        u = tl.load(
            u_ptr + (rows[:, None] * HV + hv) * V + offs_v[None, :],
            mask=live[:, None] & (offs_v < V)[None, :],
            other=0.0,
        )
        v_new = u - tl.dot(w, h, input_precision=PRECISION)
        attn = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        attn = attn * tl.exp(tl.where(causal & live[:, None], gc[:, None] - gc[None, :], float("-inf")))
        o = tl.dot(q * tl.exp(gc)[:, None], h, input_precision=PRECISION)
        o += tl.dot(attn, v_new, input_precision=PRECISION)
        tl.store(
            o_ptr + (rows[:, None] * HV + hv) * V + offs_v[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=live[:, None] & (offs_v < V)[None, :],
        )
        k_decayed = k * tl.where(live, tl.exp(last - gc), 0.0)[:, None]
        h = h * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PRECISION)
    tl.store(s_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask_kv)


@dataclass(frozen=True)
class PackedIndex:
    """Where each token and each 64-token chunk of packed sequences lies (from cu_seqlens, on the device): the same
    for every DeltaNet layer of a step, so a prefill builds it once (layers/linear_attention.py keeps it on the step's
    wave) instead of ~20 small kernels a layer. chunk_start / chunk_end are padded with empty chunks to
    tokens // CHUNK + sequences entries, a bound known without reading cu_seqlens back to the host."""

    seq_of_token: torch.Tensor  # [tokens] int64: the sequence each token belongs to
    chunk_start: torch.Tensor  # [tokens // CHUNK + sequences] int32
    chunk_end: torch.Tensor


def _seq_of_token(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    return torch.searchsorted(cu[1:].long(), torch.arange(tokens, device=cu.device), right=True)


def packed_index(cu_seqlens: torch.Tensor, tokens: int) -> PackedIndex:
    """The PackedIndex of `tokens` tokens packed as cu_seqlens says."""
    cu = cu_seqlens.long()
    seqs = cu.numel() - 1
    seq_of_token = _seq_of_token(cu, tokens)
    lens = cu[1:] - cu[:-1]
    counts = (lens + CHUNK - 1) // CHUNK
    ends = counts.cumsum(0)
    idx = torch.arange(tokens // CHUNK + seqs, device=cu.device)
    seq = torch.searchsorted(ends, idx, right=True)
    real = seq < seqs
    seq = seq.clamp(max=seqs - 1)
    start = cu[seq] + (idx - (ends[seq] - counts[seq])) * CHUNK
    end = torch.minimum(start + CHUNK, cu[seq + 1])
    return PackedIndex(seq_of_token, torch.where(real, start, 0).int(), torch.where(real, end, 0).int())


def chunk_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    index: PackedIndex | None = None,
) -> torch.Tensor:
    """Triton chunk_gated_delta_rule: a parallel pass over all chunks (WY pairs), then a scan per sequence (index:
    packed_index(cu_seqlens, tokens), where the caller keeps one for several layers)."""
    _check_shapes(q, k, v, g, beta, state)
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    seqs = cu_seqlens.numel() - 1
    o = torch.empty(tokens, hv, dv, dtype=q.dtype, device=q.device)
    if seqs == 0 or tokens == 0:
        return o
    w = torch.empty(tokens, hv, dk, dtype=torch.float32, device=q.device)
    u = torch.empty(tokens, hv, dv, dtype=torch.float32, device=q.device)
    gc = torch.empty(tokens, hv, dtype=torch.float32, device=q.device)
    bk, precision = triton.next_power_of_2(dk), "ieee" if q.dtype == torch.float32 else "tf32"
    index = index or packed_index(cu_seqlens, tokens)
    chunk_start, chunk_end = index.chunk_start, index.chunk_end
    _chunk_prepare_kernel[(chunk_start.numel(), hv)](
        k,
        v,
        g,
        beta,
        w,
        u,
        gc,
        chunk_start,
        chunk_end,
        L2_EPS,
        k.stride(0),
        v.stride(0),
        g.stride(0),
        beta.stride(0),
        HK=hk,
        HV=hv,
        K=dk,
        V=dv,
        BK=bk,
        BV=triton.next_power_of_2(dv),
        C=CHUNK,
        LOG_C=CHUNK.bit_length() - 1,
        L2NORM=use_qk_l2norm,
        PRECISION=precision,
        INV_PRECISION="ieee" if precision == "ieee" else "tf32x3",
        num_warps=8,
        num_stages=1,
    )
    programs = seqs * hv * triton.cdiv(dv, 64)
    sms = sm_count(q.device)
    bv = min(triton.next_power_of_2(dv), 64 if programs >= sms else 32)
    args = (
        q,
        k,
        w,
        u,
        gc,
        o,
        state,
        slots,
        cu_seqlens,
        dk**-0.5 if scale is None else scale,
        L2_EPS,
        q.stride(0),
        k.stride(0),
    )
    meta = {
        "HK": hk,
        "HV": hv,
        "K": dk,
        "V": dv,
        "BK": bk,
        "BV": bv,
        "C": CHUNK,
        "L2NORM": use_qk_l2norm,
        "PRECISION": precision,
        "num_warps": 8 if bv == 64 else 4,
    }

    def launch(stages: int) -> None:
        _chunk_scan_kernel[(seqs, hv, triton.cdiv(dv, bv))](*args, **meta, num_stages=stages)

    # Three stages (Triton's default) pipeline the loop's loads; where they overflow a smaller shared memory, one.
    launch_or_fallback(launch, 3, 1, key=("gdn_scan", *meta.values()))
    return o


@triton.jit
def _conv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    state_ptr,
    seq_ptr,
    cu_ptr,
    slots_ptr,
    tokens,
    dim,
    stride_x,
    stride_s,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    """Outputs of BT tokens x BD channels; a tap before its sequence's first token reads the slot's conv state."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    mt, md = t < tokens, d < dim
    seq = tl.load(seq_ptr + t, mask=mt, other=0)
    start = tl.load(cu_ptr + seq, mask=mt, other=0)
    slot = tl.load(slots_ptr + seq, mask=mt, other=0).to(tl.int64)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=md, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        p = t - (W - 1) + j
        inside = (p >= start)[:, None]
        m = mt[:, None] & md[None, :]
        xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + d[None, :], mask=m & inside, other=0.0)
        sv = tl.load(
            state_ptr + slot[:, None] * stride_s + (p - start + W - 1)[:, None] * dim + d[None, :],
            mask=m & ~inside,
            other=0.0,
        )
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * tl.load(w_ptr + d * W + j, mask=md, other=0.0)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + t.to(tl.int64)[:, None] * dim + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mt[:, None] & md[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, cu_ptr, slots_ptr, dim, stride_x, stride_s, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr
):
    """A sequence's new conv state: its last W - 1 inputs, reaching into the old state when it is shorter."""
    n = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, BW)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    p = end - (W - 1) + j
    inside = (p >= start)[:, None]
    m = (j < W - 1)[:, None] & (d < dim)[None, :]
    xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + d[None, :], mask=m & inside, other=0.0)
    base = state_ptr + slot * stride_s + d[None, :]
    sv = tl.load(base + (p - start + W - 1)[:, None] * dim, mask=m & ~inside, other=0.0)
    tl.store(base + j[:, None] * dim, (xv.to(tl.float32) + sv.to(tl.float32)).to(state_ptr.dtype.element_ty), mask=m)


def _check_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, activation: str | None) -> None:
    _check_activation(activation)
    if (
        weight.shape[0] != x.shape[1]
        or conv_state.shape[1:] != (weight.shape[1] - 1, x.shape[1])
        or conv_state.shape[0]
        and not conv_state[0].is_contiguous()
    ):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)}: "
            "need x [T, D], weight [D, W], conv_state [num_slots, W - 1, D] with each slot contiguous"
        )


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
    index: PackedIndex | None = None,
) -> torch.Tensor:
    """Triton causal_conv1d: the conv over all tokens, then each sequence's new conv state (a second launch, so no
    program overwrites a state another still reads); index: as chunk_gated_delta_rule_triton's."""
    _check_conv(x, weight, conv_state, activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, dim = x.shape
    width, seqs = weight.shape[1], cu_seqlens.numel() - 1
    weight = weight.contiguous()
    out = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    if tokens == 0 or seqs == 0:
        return out
    seq_of_token = _seq_of_token(cu_seqlens, tokens) if index is None else index.seq_of_token
    bt, bd = 16, min(triton.next_power_of_2(dim), 256)
    _conv_kernel[(triton.cdiv(tokens, bt), triton.cdiv(dim, bd))](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        conv_state,
        seq_of_token,
        cu_seqlens,
        slots,
        tokens,
        dim,
        x.stride(0),
        conv_state.stride(0),
        W=width,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BT=bt,
        BD=bd,
        num_warps=4,
    )
    _conv_state_kernel[(seqs, triton.cdiv(dim, bd))](
        x,
        conv_state,
        cu_seqlens,
        slots,
        dim,
        x.stride(0),
        conv_state.stride(0),
        W=width,
        BW=triton.next_power_of_2(width - 1),
        BD=bd,
        num_warps=4,
    )
    return out


@triton.jit
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    state_ptr,
    slots_ptr,
    dim,
    stride_x,
    stride_s,
    W: tl.constexpr,
    BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BD: tl.constexpr,
):
    """One token per sequence: window = [conv state, x], output = SiLU(window . weight), state = window[1:]."""
    n = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < dim
    j = tl.arange(0, BW)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    valid = (d * 0 + slot >= 0)[None, :]  # a vector: the interpreter refuses masks from a scalar condition
    base = state_ptr + tl.maximum(slot, 0) * stride_s + d[None, :]
    xv = tl.load(x_ptr + n * stride_x + d, mask=md, other=0.0)
    window = tl.load(base + j[:, None] * dim, mask=(j < W - 1)[:, None] & md[None, :] & valid, other=0.0)
    shifted = tl.load(base + (j + 1)[:, None] * dim, mask=(j + 1 < W - 1)[:, None] & md[None, :] & valid, other=0.0)
    window = tl.where((j == W - 1)[:, None], xv[None, :], window)
    wt = tl.load(w_ptr + d[None, :] * W + j[:, None], mask=(j < W)[:, None] & md[None, :], other=0.0)
    acc = tl.sum(window.to(tl.float32) * wt.to(tl.float32), 0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=md, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + n * dim + d, acc.to(out_ptr.dtype.element_ty), mask=md)
    shifted = tl.where((j + 1 == W - 1)[:, None], xv[None, :], shifted)
    tl.debug_barrier()  # row j+1 is read by one thread and overwritten by another: every read before any write
    tl.store(
        base + j[:, None] * dim, shifted.to(state_ptr.dtype.element_ty), mask=(j < W - 1)[:, None] & md[None, :] & valid
    )


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton causal_conv1d_update: a program per (sequence, channel block)."""
    _check_conv(x, weight, conv_state, activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    seqs, dim = x.shape
    width = weight.shape[1]
    weight = weight.contiguous()
    out = torch.empty(seqs, dim, dtype=x.dtype, device=x.device)
    if seqs == 0:
        return out
    bd = min(triton.next_power_of_2(dim), 512)
    _conv_update_kernel[(seqs, triton.cdiv(dim, bd))](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        conv_state,
        slots,
        dim,
        x.stride(0),
        conv_state.stride(0),
        W=width,
        BW=triton.next_power_of_2(width),
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BD=bd,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# the public entry points: Triton on CUDA tensors, the torch reference otherwise
# ----------------------------------------------------------------------------------------------------------------


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Gated delta rule token by token: o [T, H_v, V]; state[slots] updated in place. Without cu_seqlens each token
    is one sequence (decode); with it, each sequence's tokens run in order (a simple prefill)."""
    impl = fused_recurrent_gated_delta_rule_triton if q.is_cuda else fused_recurrent_gated_delta_rule_torch
    return impl(q, k, v, g, beta, state, slots, cu_seqlens, use_qk_l2norm, scale)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Gated delta rule for prefill in chunks of 64 tokens: o [T, H_v, V]; each sequence starts from
    state[slots[n]] and leaves its final state there."""
    impl = chunk_gated_delta_rule_triton if q.is_cuda else chunk_gated_delta_rule_torch
    return impl(q, k, v, g, beta, state, slots, cu_seqlens, use_qk_l2norm, scale)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over packed sequences, x [T, D], weight [D, W]: each sequence continues from
    conv_state[slots[n]] and leaves its last W - 1 inputs there."""
    impl = causal_conv1d_triton if x.is_cuda else causal_conv1d_torch
    return impl(x, weight, bias, conv_state, slots, cu_seqlens, activation)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv for decode, x [N, D] one token per sequence; conv_state[slots] shifted in place."""
    impl = causal_conv1d_update_triton if x.is_cuda else causal_conv1d_update_torch
    return impl(x, weight, bias, conv_state, slots, activation)

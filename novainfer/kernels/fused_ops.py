"""Fused elementwise kernels: residual add + RMSNorm (Llama's and Gemma's), rotary embedding, SiLU-and-multiply, and
the Gated DeltaNet's elementwise steps (gating, q/k L2 norm, the gated RMSNorm of its output).

In eager PyTorch each of these is 5-15 small kernels per layer; at batch 1 a decode step is bound by
that kernel count rather than by memory, so each becomes one Triton kernel here. The torch versions in
novainfer/layers/ are their references (and the CPU path); the rounding follows them: sums and the
norm in float32, results rounded to the activation dtype where Hugging Face rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    n,
    eps,
    heads,
    x_head_stride,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + (row // heads) * x_stride + (row % heads) * x_head_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)  # rounded like torch's add
        tl.store(res_out_ptr + row * res_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if OFFSET:  # Gemma: the weight stored as an offset from one, the product taken in float32
        y = (xf * rstd * (1.0 + w.to(tl.float32))).to(x.dtype)
    else:
        y = rms_scale(x, w, rstd)
    tl.store(out_ptr + row * out_stride + offs, y, mask=mask)


@triton.jit
def rms_scale(x, w, rstd):
    """weight * norm(x) given x's rstd, rounded as torch's RMSNorm: (x * rstd) to x's dtype, then times w."""
    y = (x.to(tl.float32) * rstd).to(x.dtype)
    return (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, offset: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual); x: [rows, hidden], or
    without a residual [tokens, heads, head_dim] with the last dim contiguous (q or k as views of the fused qkv
    output: each head normed in one launch, the result contiguous). offset: Gemma's form, norm(x) * (1 + weight)
    in float32 before the cast."""
    if x.dim() == 3:
        assert residual is None and x.stride(2) == 1
        tokens, heads, n = x.shape
        out = torch.empty(tokens, heads, n, dtype=x.dtype, device=x.device)
        rows, strides, res, res_out = tokens * heads, (x.stride(0), 0, n, 0), x, out
        head_stride = x.stride(1)
    else:
        rows, n = x.shape
        heads, head_stride = 1, 0
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else out
        res = residual if residual is not None else x
        strides = (x.stride(0), res.stride(0), out.stride(0), res_out.stride(0))
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            res,
            weight,
            out,
            res_out,
            *strides,
            n,
            eps,
            heads,
            head_stride,
            HAS_RESIDUAL=residual is not None,
            OFFSET=offset,
            BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8,
        )
    return out if residual is None else (out, res_out)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride,
    k_stride,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    h = tl.arange(0, BLOCK_H)
    cos1 = tl.load(cos_ptr + pos * 2 * HALF + d, mask=dmask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * 2 * HALF + d, mask=dmask, other=0.0)
    cos2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + d, mask=dmask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + d, mask=dmask, other=0.0)
    for which in tl.static_range(2):
        if which == 0:
            src, dst, stride, heads = q_ptr, q_out_ptr, q_stride, NUM_Q
        else:
            src, dst, stride, heads = k_ptr, k_out_ptr, k_stride, NUM_K
        hmask = (h < heads)[:, None]
        mask = hmask & dmask[None, :]
        base = token * stride + h[:, None] * HEAD_DIM + d[None, :]
        x1 = tl.load(src + base, mask=mask, other=0.0)
        x2 = tl.load(src + base + HALF, mask=mask, other=0.0)
        out_base = token * heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
        tl.store(dst + out_base, rope_mix(x1, cos1[None, :], -x2, sin1[None, :]), mask=mask)
        tl.store(dst + out_base + HALF, rope_mix(x2, cos2[None, :], x1, sin2[None, :]), mask=mask)
        if HEAD_DIM > 2 * HALF:  # partial rotary: the rest of each head passes through
            p = 2 * HALF + tl.arange(0, BLOCK_PASS)
            pmask = hmask & (p < HEAD_DIM)[None, :]
            rest = tl.load(src + token * stride + h[:, None] * HEAD_DIM + p[None, :], mask=pmask, other=0.0)
            tl.store(dst + token * heads * HEAD_DIM + h[:, None] * HEAD_DIM + p[None, :], rest, mask=pmask)


@triton.jit
def rope_mix(x, cos, x_rot, sin):
    """x * cos + rotate_half(x) * sin as torch rounds it: cos/sin cast to x's dtype, each product rounded."""
    dt = x.dtype
    a = (x.to(tl.float32) * cos.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    b = (x_rot.to(tl.float32) * sin.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return (a + b).to(dt)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (rows may be strided);
    returns new contiguous tensors. rotary_dim < head_dim: only each head's first rotary_dim dims turn (the caches
    are [positions, rotary_dim]); the rest is copied."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    rotary_dim = rotary_dim or head_dim
    assert q.stride(1) == head_dim and q.stride(2) == 1 and k.stride(1) == head_dim and k.stride(2) == 1
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    if tokens:
        _rotary_kernel[(tokens,)](
            positions,
            q,
            k,
            cos_cache,
            sin_cache,
            q_out,
            k_out,
            q.stride(0),
            k.stride(0),
            NUM_Q=num_q,
            NUM_K=num_k,
            HALF=rotary_dim // 2,
            HEAD_DIM=head_dim,
            BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
            BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
            BLOCK_H=triton.next_power_of_2(max(num_q, num_k)),
        )
    return q_out, k_out


@triton.jit
def _norm_rope_head(
    src,
    dst,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos,
    eps,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """One head: Gemma's RMSNorm (x * rstd * (1 + w) in float32, rounded) then neox rotary over its first 2 * HALF
    dims, as the two kernels round them (_rms_norm_kernel's OFFSET form, then _rotary_kernel)."""
    d = tl.arange(0, BLOCK_D)
    xf = tl.load(src + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HEAD_DIM + eps)
    dt = dst.dtype.element_ty
    h = tl.arange(0, BLOCK_HALF)
    hm = h < HALF
    y1 = _gemma_normed(src, w_ptr, h, hm, rstd, dt)
    y2 = _gemma_normed(src, w_ptr, HALF + h, hm, rstd, dt)
    cos1 = tl.load(cos_ptr + pos * 2 * HALF + h, mask=hm, other=0.0)
    sin1 = tl.load(sin_ptr + pos * 2 * HALF + h, mask=hm, other=0.0)
    cos2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + h, mask=hm, other=0.0)
    sin2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + h, mask=hm, other=0.0)
    tl.store(dst + h, rope_mix(y1, cos1, -y2, sin1), mask=hm)
    tl.store(dst + HALF + h, rope_mix(y2, cos2, y1, sin2), mask=hm)
    if HEAD_DIM > 2 * HALF:  # partial rotary: the rest of the head passes through, normed
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pm = p < HEAD_DIM
        tl.store(dst + p, _gemma_normed(src, w_ptr, p, pm, rstd, dt), mask=pm)


@triton.jit
def _gemma_normed(src, w_ptr, offs, mask, rstd, dt):
    """Elements offs of a row given its rstd, Gemma's way: x * rstd * (1 + w) in float32, then to dt."""
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    return (x * rstd * (1.0 + tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32))).to(dt)


@triton.jit
def _qk_norm_rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride,
    q_head_stride,
    k_stride,
    k_head_stride,
    eps,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    if head < NUM_Q:
        src = q_ptr + token * q_stride + head * q_head_stride
        dst = q_out_ptr + (token * NUM_Q + head) * HEAD_DIM
        _norm_rope_head(src, dst, qw_ptr, cos_ptr, sin_ptr, pos, eps, HALF, HEAD_DIM, BLOCK_D, BLOCK_HALF, BLOCK_PASS)
    else:
        src = k_ptr + token * k_stride + (head - NUM_Q) * k_head_stride
        dst = k_out_ptr + (token * NUM_K + head - NUM_Q) * HEAD_DIM
        _norm_rope_head(src, dst, kw_ptr, cos_ptr, sin_ptr, pos, eps, HALF, HEAD_DIM, BLOCK_D, BLOCK_HALF, BLOCK_PASS)


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (strided views of a fused
    projection's output, last dim contiguous) normed by Gemma's RMSNorm (q_weight, k_weight: offsets from one), then
    neox rotary over its first rotary_dim dims: one kernel in place of rms_norm twice and rotary_embedding, the
    same roundings. Returns new contiguous q and k."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, num_q + num_k)](
            positions,
            q,
            k,
            q_weight,
            k_weight,
            cos_cache,
            sin_cache,
            q_out,
            k_out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            eps,
            NUM_Q=num_q,
            NUM_K=num_k,
            HALF=rotary_dim // 2,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
            BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
            num_warps=1 if head_dim <= 128 else 2,
        )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + offs, silu_mul(gate, up), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up, rounded as torch: silu's result to gate's dtype before the multiply."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = concat(gate, up) along the last dim; x: [rows, 2 * d]."""
    rows, two_d = x.shape
    n = two_d // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, heads, a_stride, b_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < heads
    g, beta = gdn_gate(
        tl.load(a_ptr + row.to(tl.int64) * a_stride + offs, mask=mask, other=0.0),
        tl.load(b_ptr + row.to(tl.int64) * b_stride + offs, mask=mask, other=0.0),
        tl.load(a_log_ptr + offs, mask=mask, other=0.0),
        tl.load(dt_bias_ptr + offs, mask=mask, other=0.0),
    )
    tl.store(g_ptr + row * heads + offs, g, mask=mask)
    tl.store(beta_ptr + row * heads + offs, beta, mask=mask)


@triton.jit
def gdn_gate(a, b, a_log, dt_bias):
    """The DeltaNet's decay and write strength in float32: g = -exp(A_log) * softplus(a + dt_bias), beta =
    sigmoid(b) (the gating kernel's, and the recurrence kernel's when it takes the raw a and b)."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus (threshold 20)
    return -tl.exp(a_log.to(tl.float32)) * softplus, 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeltaNet's per-token, per-head decay and write strength in float32, one kernel:
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b: [T, heads], rows possibly strided (column
    ranges of a fused projection's output)."""
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))
    rows, heads = a.shape
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if rows:
        _gdn_gating_kernel[(rows,)](
            a, b, a_log, dt_bias, g, beta, heads, a.stride(0), b.stride(0), BLOCK=triton.next_power_of_2(heads)
        )
    return g, beta


@triton.jit
def _l2_norm_kernel(x_ptr, heads, row_stride, dim, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    ptr = x_ptr + (pid // heads) * row_stride + (pid % heads) * dim + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < dim
    x = tl.load(ptr, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    tl.store(ptr, (xf * tl.rsqrt(tl.sum(xf * xf, 0) + eps)).to(x.dtype), mask=mask)


def l2_norm_heads_(x: torch.Tensor, heads: int, dim: int, eps: float = 1e-6) -> None:
    """In place: x[:, :heads * dim] viewed as heads of dim, each scaled to unit L2 norm (x / sqrt(sum x^2 + eps)),
    in float32; x: [T, >= heads * dim] with unit stride in its last dim."""
    rows = x.shape[0]
    if rows:
        _l2_norm_kernel[(rows * heads,)](x, heads, x.stride(0), dim, eps, BLOCK=triton.next_power_of_2(dim))


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, dim, heads, z_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * dim + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)).to(x.dtype)
    y = (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * y.to(tl.float32)).to(x.dtype)
    z_row = z_ptr + (row // heads).to(tl.int64) * z_stride + (row % heads) * dim
    z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + offs, (y.to(tl.float32) * (z / (1.0 + tl.exp(-z)))).to(x.dtype), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * norm(x) * silu(z) over the last dim, one kernel; rounded as the torch GatedRMSNorm: the norm to x's
    dtype, times the weight in x's dtype, times silu(z) in float32, then to x's dtype. x: contiguous
    [tokens, heads, dim]; z the same shape, its tokens possibly strided (a column range of a fused projection)."""
    tokens, heads, dim = x.shape
    if z.stride(2) != 1 or z.stride(1) != dim:
        z = z.contiguous()
    out = torch.empty_like(x)
    if tokens * heads:
        _gated_rms_norm_kernel[(tokens * heads,)](
            x, z, weight, out, dim, heads, z.stride(0), eps, BLOCK=triton.next_power_of_2(dim)
        )
    return out

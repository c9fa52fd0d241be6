"""GGUF weights kept quantized on the GPU (layers/quantization/gguf_gpu.py): a decode GEMV and a prefill GEMM.

Layout. GGML interleaves each block's float16 factors with its quants (an 18..210-byte record), which no GPU load
reads coalesced and 16 bytes wide. At load each tensor is repacked, without re-quantizing, into separate contiguous
arrays, row major like a bf16 weight (a row's quants run contiguously along K):
- qweight: 4-bit types (Q4_0, Q4_1, Q4_K) uint8 [N, K/2], each group of 32 inputs as 16 bytes, byte i holding input
  i (low nibble) and i + 16 (high; GGML's own Q4_0 order); 5/6/8-bit types (Q5_K, Q6_K, Q8_0) int8 [N, K], one
  value a byte (Q5_K 0..31, Q6_K -32..31 with GGML's offset applied): 8 bits a weight in memory instead of
  5.5 / 6.6, bought for a plain byte load;
- d: float16 [N, K / SUPER], the file's block factor (SUPER = 256 for the K-quants, the group for the others);
- sc: the K-quants' per-group sub-scales [N, K / GROUP] (uint8 6-bit for Q4_K / Q5_K, int8 for Q6_K), or None;
- dm: float16 [N, K / SUPER], the zero's factor (-dmin for Q4_K / Q5_K, Q4_1's m), or None;
- mn: uint8 [N, K / GROUP], the K-quants' 6-bit mins, or None.
  w[n, k] = (q - OFF) * d[n, s] * sc[n, g] + dm[n, s] * mn[n, g]  (g = k // GROUP, s = g // SUB; absent terms 1,
  OFF = 8 for Q4_0, else 0): the products GGML forms, in float32, so the repack is exact and Q4_K costs 4.6 bits a
  weight (the file's 4.5).

gguf_gemv: up to GEMV_MAX_M rows of x (decode). A program takes BLOCK_N whole weight rows, reads each weight byte
once for all rows of x and sums over the whole of K in float32 registers (a 7B's 3584-row layers make 448
programs: no split-K, atomics or zeroed buffer). The zero term is folded per group: sum(x * zero) = zero * sum(x).
gguf_gemm: more rows; a [BLOCK_N, BLOCK_K] tile is dequantized into registers in x's dtype, then tl.dot (two per
step for 4-bit types: the low and the high nibbles, with x's matching columns), split along K with float32 atomics
where the output tiles alone would leave SMs idle.
The torch reference is dequantize() (then a matmul); tests check it against gguf.quants.dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from novainfer.kernels.tiling import grouped_tile, row_bucket, split_k


@dataclass(frozen=True)
class GGUFFormat:
    """How one GGML type is laid out after the repack (see the module docstring)."""

    q4: bool
    group: int
    sub: int  # groups per d / dm factor
    off: int
    has_sc: bool
    has_dm: bool
    has_mn: bool


FORMATS = {
    "Q4_0": GGUFFormat(True, 32, 1, 8, False, False, False),
    "Q4_1": GGUFFormat(True, 32, 1, 0, False, True, False),
    "Q8_0": GGUFFormat(False, 32, 1, 0, False, False, False),
    "Q4_K": GGUFFormat(True, 32, 8, 0, True, True, True),
    "Q5_K": GGUFFormat(False, 32, 8, 0, True, True, True),
    "Q6_K": GGUFFormat(False, 16, 16, 0, True, False, False),
}


@dataclass
class GGUFWeight:
    """A [N, K] GGUF weight in the GPU layout (one GGML type; a fused layer of mixed types holds several)."""

    qtype: str
    qweight: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None
    dm: torch.Tensor | None
    mn: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def fmt(self) -> GGUFFormat:
        return FORMATS[self.qtype]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.d, self.sc, self.dm, self.mn) if t is not None]

    def nbytes(self) -> int:
        """Bytes one pass over the weight reads."""
        return sum(t.nbytes for t in self.tensors())

    def select_rows(self, rows: torch.Tensor) -> "GGUFWeight":
        """The weight's rows `rows` (an embedding lookup's gather)."""
        pick = [
            None if t is None else t.index_select(0, rows) for t in (self.qweight, self.d, self.sc, self.dm, self.mn)
        ]
        return GGUFWeight(self.qtype, *pick, (rows.numel(), self.shape[1]))

    @staticmethod
    def cat_rows(parts: list["GGUFWeight"]) -> "GGUFWeight":
        """Parts of one type stacked along N (the shards of a fused layer)."""
        first = parts[0]

        def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)

        fields = zip(*[(p.qweight, p.d, p.sc, p.dm, p.mn) for p in parts])
        return GGUFWeight(
            first.qtype, *[cat(list(f)) for f in fields], (sum(p.shape[0] for p in parts), first.shape[1])
        )


def dequantize(w: GGUFWeight) -> torch.Tensor:
    """The float32 [N, K] weight in torch (the kernels' reference, the embedding lookup, the CPU fallback)."""
    f = w.fmt
    n, k = w.shape
    if f.q4:
        b = w.qweight.view(n, k // 32, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()  # [n, groups, 32]: byte i holds inputs i and i + 16
    else:
        q = w.qweight.float().view(n, k // f.group, f.group)
    scale = w.d.float().repeat_interleave(f.sub, 1)
    if f.has_sc:
        scale = scale * w.sc.float()
    out = (q - f.off) * scale[:, :, None]
    if f.has_dm:
        zero = w.dm.float().repeat_interleave(f.sub, 1)
        if f.has_mn:
            zero = zero * w.mn.float()
        out += zero[:, :, None]
    return out.view(n, k)


@triton.jit
def _scale_zero(
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    rows,
    g,
    NG,
    NS,
    SUB: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
):
    """Scale and zero [rows, groups] in float32 for weight rows `rows` (int64) and groups g (0 past the row's end)."""
    gi = rows[:, None] * NG + g[None, :]
    si = rows[:, None] * NS + (g // SUB)[None, :]
    mask = (g < NG)[None, :]
    scale = tl.load(d_ptr + si, mask=mask, other=0.0).to(tl.float32)
    if HAS_SC:
        scale *= tl.load(sc_ptr + gi, mask=mask, other=0).to(tl.float32)
    zero = tl.zeros_like(scale)
    if HAS_DM:
        zero = tl.load(dm_ptr + si, mask=mask, other=0.0).to(tl.float32)
        if HAS_MN:
            zero *= tl.load(mn_ptr + gi, mask=mask, other=0).to(tl.float32)
    return scale, zero


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    stride_xm,
    stride_om,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    Q4: tl.constexpr,
    GROUP: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // GROUP  # groups a step
    W: tl.constexpr = GROUP // 2 if Q4 else GROUP  # bytes of a group in a row
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no masks on the loads
    chunk = tl.arange(0, C)
    lane = tl.arange(0, W)
    NG = K // GROUP
    NS = NG // SUB
    q_ptrs = q_ptr + rload[:, None, None] * stride_qn + (chunk[:, None] * W + lane[None, :])[None, :, :]
    x_off = chunk[:, None] * GROUP + lane[None, :]  # [C, W]: the inputs of each group's bytes (low nibbles)
    mrow = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP + chunk
        scale, zero = _scale_zero(d_ptr, sc_ptr, dm_ptr, mn_ptr, rload, g, NG, NS, SUB, HAS_SC, HAS_DM, HAS_MN)
        qp = q_ptrs + k0 // (2 if Q4 else 1)
        if EVEN_K:
            q = tl.load(qp, eviction_policy="evict_first")
        else:
            q = tl.load(qp, mask=(g < NG)[None, :, None], other=0, eviction_policy="evict_first")
        if Q4:
            lo = (q & 15).to(tl.float32) - OFF
            hi = (q >> 4).to(tl.float32) - OFF
        else:
            lo = q.to(tl.float32) - OFF
        xmask = (k0 + x_off) < K
        for m in tl.static_range(M):
            xp = x_ptr + m * stride_xm + k0 + x_off
            xl = tl.load(xp, mask=xmask, other=0.0).to(tl.float32)
            dot = tl.sum(lo * xl[None, :, :], 2)
            xs = tl.sum(xl, 1)
            if Q4:
                xh = tl.load(xp + W, mask=xmask, other=0.0).to(tl.float32)
                dot += tl.sum(hi * xh[None, :, :], 2)
                xs += tl.sum(xh, 1)
            part = dot * scale
            if HAS_DM:
                part += zero * xs[None, :]
            acc += tl.where(mrow[:, None] == m, tl.sum(part, 1)[None, :], 0.0)
    omask = (mrow < M)[:, None] & (rows < N)[None, :]
    tl.store(out_ptr + mrow[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_xm,
    stride_om,
    K_PER_SPLIT,
    Q4: tl.constexpr,
    GROUP: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // GROUP
    W: tl.constexpr = GROUP // 2 if Q4 else GROUP
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mload = tl.minimum(offs_m, M - 1).to(tl.int64)  # edge tiles re-read the last row/column: unmasked loads
    nload = tl.minimum(offs_n, N - 1).to(tl.int64)
    chunk = tl.arange(0, C)
    lane = tl.arange(0, W)
    NG = K // GROUP
    NS = NG // SUB
    q_ptrs = q_ptr + nload[:, None, None] * stride_qn + (chunk[:, None] * W + lane[None, :])[None, :, :]
    x_cols = tl.reshape(chunk[:, None] * GROUP + lane[None, :], [C * W])  # the inputs of the tile's (low) bytes
    x_ptrs = x_ptr + mload[:, None] * stride_xm + x_cols[None, :]
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # BLOCK_K divides K and K_PER_SPLIT: no K masks
        g = k0 // GROUP + chunk
        scale, zero = _scale_zero(d_ptr, sc_ptr, dm_ptr, mn_ptr, nload, g, NG, NS, SUB, HAS_SC, HAS_DM, HAS_MN)
        q = tl.load(q_ptrs + k0 // (2 if Q4 else 1))
        a = tl.load(x_ptrs + k0)
        if Q4:
            lo = ((q & 15).to(tl.float32) - OFF) * scale[:, :, None] + zero[:, :, None]
            w = tl.trans(tl.reshape(lo, [BLOCK_N, C * W]).to(a.dtype))
            acc = tl.dot(a, w, acc)
            hi = ((q >> 4).to(tl.float32) - OFF) * scale[:, :, None] + zero[:, :, None]
            w = tl.trans(tl.reshape(hi, [BLOCK_N, C * W]).to(a.dtype))
            acc = tl.dot(tl.load(x_ptrs + k0 + W), w, acc)
        else:
            v = (q.to(tl.float32) - OFF) * scale[:, :, None] + zero[:, :, None]
            acc = tl.dot(a, tl.trans(tl.reshape(v, [BLOCK_N, BLOCK_K]).to(a.dtype)), acc)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT > 1:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


GEMV_MAX_M = 8  # up to this many rows of x go through the GEMV (one read of the weight for all rows)

# (BLOCK_N, BLOCK_K, num_warps) of the GEMV; BLOCK_K is capped at K's power of two above (a masked tail step).
# Reasoned defaults (a step reads BLOCK_N * BLOCK_K / 2 bytes of a 4-bit type: 16 bytes a thread or more), not yet
# swept on a GPU: benchmarks/gguf_gpu.py times GEMV_CANDIDATES and prints the best
GEMV_CANDIDATES: list[tuple[int, int, int]] = [(8, 512, 4), (4, 512, 4), (8, 1024, 4), (16, 512, 8), (4, 1024, 4)]
GEMV_DEFAULT = (8, 512, 4)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the row count's bucket (BLOCK_K halved until it divides K)
GEMM_CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {
    32: [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (16, 128, 64, 4, 3)],
    128: [(64, 64, 128, 4, 3), (32, 128, 128, 4, 3), (64, 128, 64, 4, 3)],
    1 << 30: [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3)],
}


def _args(w: GGUFWeight) -> list[torch.Tensor]:
    """The kernels' six weight pointers (an absent array passes d, never read)."""
    return [w.qweight, w.d, *(w.d if t is None else t for t in (w.sc, w.dm, w.mn))]


def _consts(w: GGUFWeight) -> dict:
    f = w.fmt
    return dict(Q4=f.q4, GROUP=f.group, SUB=f.sub, OFF=f.off, HAS_SC=f.has_sc, HAS_DM=f.has_dm, HAS_MN=f.has_mn)


def gguf_gemv(
    x: torch.Tensor, w: GGUFWeight, out: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit stride along K) times w^T -> out [M, N] (x's dtype; out may be a column
    slice of a wider output)."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= GEMV_MAX_M and x.stride(1) == 1 and k == w.shape[1], (x.shape, w.shape)
    if tiles is None and not x.is_cuda:
        tiles = (4, 64, 4)  # the interpreter: small tiles
    block_n, block_k, warps = tiles or GEMV_DEFAULT
    block_k = max(w.fmt.group, min(block_k, triton.next_power_of_2(k)))
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        *_args(w),
        out,
        n,
        k,
        w.qweight.stride(0),
        x.stride(0),
        out.stride(0),
        M=m,
        BLOCK_M=max(2, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        **_consts(w),
    )
    return out


def gguf_gemm(
    x: torch.Tensor,
    w: GGUFWeight,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x [M, K] (unit stride along K) times w^T -> out [M, N] in x's dtype; split: the K splits (None: as many
    as fill the GPU's SMs once with programs)."""
    m, k = x.shape
    n = w.shape[0]
    assert x.stride(1) == 1 and k == w.shape[1], (x.shape, w.shape)
    if x.is_cuda:
        block_m, block_n, block_k, warps, stages = tiles or GEMM_CANDIDATES[row_bucket(m, GEMM_CANDIDATES)][0]
    else:
        block_m, block_n, block_k, warps, stages = 16, 32, 64, 4, 1
    block_k = max(block_k, w.fmt.group)
    while k % block_k:  # whole groups dividing K (K is a multiple of the GGML block: 32 or 256)
        block_k //= 2
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split is None:
        split, per_split = split_k(k, tiles_mn, block_k, x.device, programs_per_sm=1)
    else:
        per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
        split = triton.cdiv(k, per_split)
    dst = out if split == 1 else torch.zeros((m, n), dtype=torch.float32, device=x.device)
    if dst is None:
        dst = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gguf_gemm_kernel[(tiles_mn, split)](
        x,
        *_args(w),
        dst,
        m,
        n,
        k,
        w.qweight.stride(0),
        x.stride(0),
        dst.stride(0),
        per_split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
        **_consts(w),
    )
    if split == 1:
        return dst
    if out is None:
        return dst.to(x.dtype)
    out.copy_(dst)
    return out


def gguf_matmul(x: torch.Tensor, parts: list[GGUFWeight]) -> torch.Tensor:
    """x [M, K] times a layer's weight (its parts stacked along N, one GGML type each) -> [M, N] in x's dtype."""
    x = x.contiguous()
    m = x.shape[0]
    kernel = gguf_gemv if m <= GEMV_MAX_M else gguf_gemm
    if len(parts) == 1:
        return kernel(x, parts[0])
    out = torch.empty((m, sum(p.shape[0] for p in parts)), dtype=x.dtype, device=x.device)
    at = 0
    for p in parts:
        kernel(x, p, out[:, at : at + p.shape[0]])
        at += p.shape[0]
    return out

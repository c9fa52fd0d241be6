"""GGUF weights kept quantized on the GPU (layers/quantization/gguf_gpu.py): a decode GEMV and a prefill GEMM.

Layout. GGML interleaves each block's float16 factors with its quants (an 18..210-byte record), which no GPU load
reads coalesced and 16 bytes wide. At load each tensor is repacked, without re-quantizing, into separate contiguous
arrays, row major like a bf16 weight (a row's quants run contiguously along K):
- qweight: every type but Q8_0 uint8 [N, K/2], the low four bits of each input, each group of 32 inputs as 16
  bytes, byte i holding input i (low nibble) and i + 16 (high nibble; GGML's own Q4_0 order); Q8_0 int8 [N, K];
- qh: the bits above the fourth (Q5_K one, Q6_K two) in a plane uint8 [N, K/32 * 4 * HB]: of each group's 4 * HB
  bytes, byte b holds inputs b, b + 4 HB, b + 8 HB, ... at bits 0, HB, 2 HB, ... so a thread's 16 inputs need one
  small load; None for the others;
- d: float16 [N, K / SUPER], the file's block factor (SUPER = 256 for the K-quants, 32 for the others);
- sc: the K-quants' sub-scales [N, K / SG] (SG = 32; Q6_K's int8 per 16 inputs, SG = 16), or None;
- dm: float16 [N, K / SUPER], the zero's factor (-dmin for Q4_K / Q5_K, Q4_1's m), or None;
- mn: uint8 [N, K / 32], the K-quants' 6-bit mins, or None.
  w[n, k] = (q - OFF) * d[n, s] * sc[n, g] + dm[n, s] * mn[n, g]  (g = k // SG, s = k // SUPER; absent terms 1,
  OFF = 8 for Q4_0, 32 for Q6_K, else 0): the products GGML forms, in float32, so the repack is exact and each
  type keeps about its file size (Q4_K 4.6 bits a weight, Q5_K 5.6, Q6_K 6.6, Q8_0 8.5).

gguf_matmul picks: the GEMV at GEMV_MAX_M rows (decode at batch 1), else gguf_dequantize (a Triton kernel writing
the dense weight in x's dtype, into a transient buffer) and cuBLAS: on an H200 the GEMV ran at 0.2-0.5x of bf16
from 4 rows and the GEMM at 0.04-0.07x from 256 rows (benchmarks/gguf_gpu.py, Qwen2.5-7B's Q4_K/Q6_K layers).
gguf_gemv: up to GEMV_ROWS rows of x. A program takes BLOCK_N whole weight rows, reads each weight byte
once for all rows of x and sums over the whole of K in float32 registers (a 7B's 3584-row layers make 448
programs: no split-K, atomics or zeroed buffer). At one row (batch-1 decode) the scaled products accumulate
elementwise in a [BLOCK_N, BLOCK_K / 2] float32 tile reduced once at the end, as kernels/gemv.py's do, instead of a
reduction across threads every step. The zero term is folded per group: sum(x * zero) = zero * sum(x).
Quants become floats by the 2^23 bit trick (_quants), without conversion instructions.
gguf_gemm (not taken by gguf_matmul until its tiles are tuned; benchmarks/gguf_gpu.py times it): a [BLOCK_N, BLOCK_K] tile is dequantized into registers in x's dtype, then tl.dot (two per
step for 4-bit types: the low and the high nibbles, with x's matching columns), split along K with float32 atomics
where the output tiles alone would leave SMs idle.
The torch reference is dequantize() (then a matmul); tests check it against gguf.quants.dequantize. The GEMV's tiles
come from benchmarks/gguf_gpu.py's H200 sweep on 7B layers; the GEMM's are reasoned defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from novainfer.kernels.int4_gemm import MAGIC
from novainfer.kernels.tiling import even_split, grouped_tile, row_bucket, split_k


@dataclass(frozen=True)
class GGUFFormat:
    """How one GGML type is laid out after the repack (see the module docstring)."""

    q4: bool  # low nibbles in qweight (every type but Q8_0)
    hb: int  # bits a weight in the qh plane
    half: bool  # sub-scales per 16 inputs: a group of 32's low nibbles take one, its high nibbles the next (Q6_K)
    sub: int  # scale groups per d / dm factor
    off: int
    has_sc: bool
    has_dm: bool
    has_mn: bool

    @property
    def scale_group(self) -> int:
        return 16 if self.half else 32


FORMATS = {
    "Q4_0": GGUFFormat(True, 0, False, 1, 8, False, False, False),
    "Q4_1": GGUFFormat(True, 0, False, 1, 0, False, True, False),
    "Q8_0": GGUFFormat(False, 0, False, 1, 0, False, False, False),
    "Q4_K": GGUFFormat(True, 0, False, 8, 0, True, True, True),
    "Q5_K": GGUFFormat(True, 1, False, 8, 0, True, True, True),
    "Q6_K": GGUFFormat(True, 2, True, 16, 32, True, False, False),
}
ARRAYS = ("qweight", "d", "sc", "dm", "mn", "qh")


@dataclass
class GGUFWeight:
    """A [N, K] GGUF weight in the GPU layout (one GGML type; a fused layer of mixed types holds several)."""

    qtype: str
    qweight: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None
    dm: torch.Tensor | None
    mn: torch.Tensor | None
    qh: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def fmt(self) -> GGUFFormat:
        return FORMATS[self.qtype]

    def arrays(self) -> list[torch.Tensor | None]:
        """The ARRAYS in order (None where the type has none)."""
        return [getattr(self, a) for a in ARRAYS]

    def nbytes(self) -> int:
        """Bytes one pass over the weight reads."""
        return sum(t.nbytes for t in self.arrays() if t is not None)

    def map(self, fn, rows: int) -> "GGUFWeight":
        """The weight whose arrays are fn(array), with `rows` rows (a gather, a copy)."""
        return GGUFWeight(self.qtype, *[None if t is None else fn(t) for t in self.arrays()], (rows, self.shape[1]))

    def select_rows(self, rows: torch.Tensor) -> "GGUFWeight":
        """The weight's rows `rows` (an embedding lookup's gather)."""
        return self.map(lambda t: t.index_select(0, rows), rows.numel())

    @staticmethod
    def cat_rows(parts: list["GGUFWeight"]) -> "GGUFWeight":
        """Parts of one type stacked along N (the shards of a fused layer)."""
        arrays = [None if ts[0] is None else torch.cat(ts) for ts in zip(*[p.arrays() for p in parts])]
        return GGUFWeight(parts[0].qtype, *arrays, (sum(p.shape[0] for p in parts), parts[0].shape[1]))


def pack_nibbles(v: torch.Tensor, hb: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quants uint8 [n, k] in input order (0 .. 2^(4 + hb) - 1) -> (qweight [n, k/2], qh plane or None)."""
    n, k = v.shape
    v = v.view(n, k // 32, 32)
    low = v & 15
    q = (low[..., :16] | (low[..., 16:] << 4)).reshape(n, k // 2)
    if not hb:
        return q, None
    nb = 4 * hb  # bytes a group; input e sits in byte e % nb at bit hb * (e // nb)
    h = (v >> 4).to(torch.int32).view(n, k // 32, 32 // nb, nb)
    shift = (hb * torch.arange(32 // nb, device=v.device, dtype=torch.int32)).view(1, 1, -1, 1)
    return q, (h << shift).sum(2).to(torch.uint8).reshape(n, -1)


def dequantize(w: GGUFWeight) -> torch.Tensor:
    """The float32 [N, K] weight in torch (the kernels' reference, the embedding lookup, the CPU fallback)."""
    f = w.fmt
    n, k = w.shape
    if f.q4:
        b = w.qweight.view(n, k // 32, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1).to(torch.int32)  # [n, groups, 32]: byte i holds inputs i, i + 16
        if f.hb:
            nb, e = 4 * f.hb, torch.arange(32, device=b.device)
            h = w.qh.view(n, k // 32, nb).to(torch.int32)[..., e % nb]
            q |= ((h >> (f.hb * (e // nb)).to(torch.int32)) & ((1 << f.hb) - 1)) << 4
        q = q.float()
    else:
        q = w.qweight.float()
    q = q.view(n, k // f.scale_group, f.scale_group)
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
    """Scale and zero [rows, groups] in float32 for weight rows `rows` (int64) and scale groups g (of NG a row;
    0 past the row's end)."""
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
def _group_scales(
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    rows,
    g,
    K,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
):
    """(scale, zero) of the low and of the high nibbles of groups g (of 32 inputs), each [rows, groups]."""
    if HALF:  # sub-scales per 16 inputs: the low nibbles (inputs 0..15) take one, the high ones the next
        ng = K // 16
        s_lo, z_lo = _scale_zero(d_ptr, sc_ptr, dm_ptr, mn_ptr, rows, 2 * g, ng, ng // SUB, SUB, HAS_SC, HAS_DM, HAS_MN)
        s_hi, z_hi = _scale_zero(
            d_ptr, sc_ptr, dm_ptr, mn_ptr, rows, 2 * g + 1, ng, ng // SUB, SUB, HAS_SC, HAS_DM, HAS_MN
        )
    else:
        ng = K // 32
        s_lo, z_lo = _scale_zero(d_ptr, sc_ptr, dm_ptr, mn_ptr, rows, g, ng, ng // SUB, SUB, HAS_SC, HAS_DM, HAS_MN)
        s_hi, z_hi = s_lo, z_lo
    return s_lo, z_lo, s_hi, z_hi


@triton.jit
def _quants(q, h, lane, Q4: tl.constexpr, HB: tl.constexpr, NB: tl.constexpr, OFF: tl.constexpr):
    """A tile's bytes (and high-bit plane bytes) -> its low and high nibbles' quants minus OFF, as float32 (Q8_0: its
    int8 values, hi unused). No int-to-float conversion (a quarter-rate instruction, which would bound a GEMV below
    HBM's rate): a value 0 <= v < 2^23 OR-ed into the float32 bits of 2^23 reads as 2^23 + v."""
    if Q4:
        lo = (q & 15).to(tl.int32)
        hi = (q >> 4).to(tl.int32)
        if HB > 0:
            hv = h.to(tl.int32)
            lo |= ((hv >> (HB * (lane // NB))[None, None, :]) & ((1 << HB) - 1)) << 4
            hi |= ((hv >> (HB * ((lane + 16) // NB))[None, None, :]) & ((1 << HB) - 1)) << 4
        bias: tl.constexpr = 8388608.0 + OFF
    else:
        lo = q.to(tl.int32) + 128  # int8 -> 0..255
        hi = lo
        bias: tl.constexpr = 8388608.0 + 128 + OFF
    lo = (lo | MAGIC).to(tl.float32, bitcast=True) - bias
    hi = (hi | MAGIC).to(tl.float32, bitcast=True) - bias
    return lo, hi


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_hn,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // 32  # groups of 32 inputs a step
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no masks on the loads
    chunk = tl.arange(0, C)
    lane = tl.arange(0, W)
    q_ptrs = q_ptr + rload[:, None, None] * stride_qn + (chunk[:, None] * W + lane[None, :])[None, :, :]
    h_ptrs = h_ptr + rload[:, None, None] * stride_hn + (chunk[:, None] * NB + lane[None, :] % NB)[None, :, :]
    x_off = chunk[:, None] * 32 + lane[None, :]  # [C, W]: the inputs of each group's bytes (low nibbles)
    mrow = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // 32 + chunk
        s_lo, z_lo, s_hi, z_hi = _group_scales(
            d_ptr, sc_ptr, dm_ptr, mn_ptr, rload, g, K, HALF, SUB, HAS_SC, HAS_DM, HAS_MN
        )
        gmask = (g < K // 32)[None, :, None]
        qp = q_ptrs + k0 // (32 // W)
        hp = h_ptrs + (k0 // 32) * NB
        if EVEN_K:
            q = tl.load(qp, eviction_policy="evict_first")
        else:
            q = tl.load(qp, mask=gmask, other=0, eviction_policy="evict_first")
        h = q
        if HB > 0:
            h = tl.load(hp, mask=gmask, other=0, eviction_policy="evict_first")
        lo, hi = _quants(q, h, lane, Q4, HB, NB, OFF)
        xmask = (k0 + x_off) < K
        for m in tl.static_range(BLOCK_M):  # rows m >= M read zeros and are not stored
            xp = x_ptr + m * stride_xm + k0 + x_off
            xm = xmask & (x_off * 0 + m < M)
            xl = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            part = tl.sum(lo * xl[None, :, :], 2) * s_lo
            if HAS_DM:
                part += z_lo * tl.sum(xl, 1)[None, :]
            if Q4:
                xh = tl.load(xp + 16, mask=xm, other=0.0).to(tl.float32)
                part += tl.sum(hi * xh[None, :, :], 2) * s_hi
                if HAS_DM:
                    part += z_hi * tl.sum(xh, 1)[None, :]
            acc += tl.where(mrow[:, None] == m, tl.sum(part, 1)[None, :], 0.0)
    omask = (mrow < M)[:, None] & (rows < N)[None, :]
    tl.store(out_ptr + mrow[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _dp4a(a, b, c, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """c plus the four byte products of int32 words a and b (b's bytes signed, a's signed where SIGNED_A): PTX's
    dp4a, four multiply-adds in one integer instruction; a shift-and-multiply emulation under the interpreter."""
    if ASM:
        if SIGNED_A:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], tl.int32, True, 1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], tl.int32, True, 1)
    else:
        acc = c
        for i in tl.static_range(4):
            if SIGNED_A:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 0xFF
            acc += ai * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def _q8_words(q_ptr, h_ptr, rload, chunk, word, k0, stride_qw, stride_hw, gmask, Q4: tl.constexpr, HB: tl.constexpr):
    """A step's weights as int32 words of four byte quants [rows, C, 4]: lo holds inputs 4 w .. 4 w + 3 of each group
    of 32, hi inputs 16 + 4 w .. (Q4: a word's low nibbles and its high nibbles, the qh plane's bits above them)."""
    if Q4:
        qw = tl.load(
            q_ptr + rload[:, None, None] * stride_qw + (k0 // 8 + chunk[:, None] * 4 + word[None, :])[None, :, :],
            mask=gmask,
            other=0,
            eviction_policy="evict_first",
        )
        lo = qw & 0x0F0F0F0F
        hi = (qw >> 4) & 0x0F0F0F0F
        if HB > 0:  # input e of a group: byte e % (4 HB) of its qh bytes, bits HB * (e // (4 HB))
            hmask: tl.constexpr = 0x01010101 * ((1 << HB) - 1)
            hrow = h_ptr + rload[:, None, None] * stride_hw + ((k0 // 32 + chunk) * HB)[None, :, None]
            hl = tl.load(hrow + (word % HB)[None, None, :], mask=gmask, other=0, eviction_policy="evict_first")
            hh = tl.load(hrow + ((word + 4) % HB)[None, None, :], mask=gmask, other=0, eviction_policy="evict_first")
            lo |= ((hl >> (HB * (word // HB))[None, None, :]) & hmask) << 4
            hi |= ((hh >> (HB * ((word + 4) // HB))[None, None, :]) & hmask) << 4
    else:  # Q8_0: eight words a group, its int8 values as stored
        wp = q_ptr + rload[:, None, None] * stride_qw + (k0 // 4 + chunk[:, None] * 8 + word[None, :])[None, :, :]
        lo = tl.load(wp, mask=gmask, other=0, eviction_policy="evict_first")
        hi = tl.load(wp + 4, mask=gmask, other=0, eviction_policy="evict_first")
    return lo, hi


@triton.jit
def _gemv_q8_rows(
    xq_ptr,
    dx_ptr,
    sx_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    rload,
    K,
    stride_qw,
    stride_hw,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """One row of x, quantized by _quantize_q8_kernel (xq_ptr, dx_ptr, sx_ptr at that row), times weight rows rload
    (int64, in range) -> float32 [BLOCK_N]: per group of 32 inputs eight dp4a a row (the integer sum of quants times
    int8 inputs, exact), then scale * dx * sum + zero * sx, where sx = dx * (the group's sum of int8 inputs) and OFF
    is folded into the zero. Sums in a [BLOCK_N, C, 4] float32 tile, reduced once at the end (the dense GEMV's body
    and the MoE GEMV's of kernels/fused_moe_gguf.py, whose rows start at an expert's)."""
    C: tl.constexpr = BLOCK_K // 32
    chunk = tl.arange(0, C)
    word = tl.arange(0, 4)
    x_words = (chunk[:, None] * 8 + word[None, :])[None, :, :]  # [1, C, 4]: inputs 4 w .. 4 w + 3 of each group
    acc = tl.zeros([BLOCK_N, C, 4], tl.float32)
    accz = tl.zeros([BLOCK_N, C], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // 32 + chunk
        in_k = g < K // 32
        gmask = in_k[None, :, None]
        s_lo, z_lo, s_hi, z_hi = _group_scales(
            d_ptr, sc_ptr, dm_ptr, mn_ptr, rload, g, K, HALF, SUB, HAS_SC, HAS_DM, HAS_MN
        )
        lo, hi = _q8_words(q_ptr, h_ptr, rload, chunk, word, k0, stride_qw, stride_hw, gmask, Q4, HB)
        xl = tl.load(xq_ptr + k0 // 4 + x_words, mask=gmask, other=0)
        xh = tl.load(xq_ptr + k0 // 4 + 4 + x_words, mask=gmask, other=0)
        dx = tl.load(dx_ptr + g, mask=in_k, other=0.0)[None, :]
        if HALF:  # the low and the high nibbles have their own scales
            acc += _dp4a(lo, xl, tl.zeros_like(lo), not Q4, ASM).to(tl.float32) * (s_lo * dx)[:, :, None]
            acc += _dp4a(hi, xh, tl.zeros_like(hi), not Q4, ASM).to(tl.float32) * (s_hi * dx)[:, :, None]
        else:  # one scale a group: one integer sum, one conversion
            dot = _dp4a(hi, xh, _dp4a(lo, xl, tl.zeros_like(lo), not Q4, ASM), not Q4, ASM)
            acc += dot.to(tl.float32) * (s_lo * dx)[:, :, None]
        sx_lo = tl.load(sx_ptr + 2 * g, mask=in_k, other=0.0)[None, :]
        sx_hi = tl.load(sx_ptr + 2 * g + 1, mask=in_k, other=0.0)[None, :]
        accz += (z_lo - OFF * s_lo) * sx_lo + (z_hi - OFF * s_hi) * sx_hi
    return tl.sum(tl.sum(acc, 2), 1) + tl.sum(accz, 1)


@triton.jit
def _gguf_gemv_q8_kernel(
    xq_ptr,
    dx_ptr,
    sx_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    out_ptr,
    N,
    K,
    stride_qw,
    stride_hw,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """One row of x, quantized by _quantize_q8_kernel, times BLOCK_N weight rows a program (_gemv_q8_rows)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1: no row masks on the loads
    y = _gemv_q8_rows(
        xq_ptr,
        dx_ptr,
        sx_ptr,
        q_ptr,
        d_ptr,
        sc_ptr,
        dm_ptr,
        mn_ptr,
        h_ptr,
        rload,
        K,
        stride_qw,
        stride_hw,
        Q4,
        HB,
        HALF,
        SUB,
        OFF,
        HAS_SC,
        HAS_DM,
        HAS_MN,
        BLOCK_N,
        BLOCK_K,
        ASM,
    )
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _quantize_q8_kernel(x_ptr, xq_ptr, dx_ptr, sx_ptr, K, BLOCK: tl.constexpr):
    """BLOCK inputs of one row a program -> int8 round(x / dx) with dx = amax / 127 per group of 32 (llama.cpp's
    q8_1 for its MMVQ), and sx = dx * (the int8 values' sum) per 16 inputs (the zero terms' sum of x)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.reshape(tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32), [BLOCK // 32, 32])
    amax = tl.max(tl.abs(x), 1)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    q = tl.floor(x * inv[:, None] + 0.5)
    dx = amax / 127.0
    tl.store(xq_ptr + offs, tl.reshape(q, [BLOCK]).to(tl.int8), mask=offs < K)
    g = tl.program_id(0) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(dx_ptr + g, dx, mask=g < K // 32)
    sums = tl.sum(tl.reshape(q, [BLOCK // 16, 16]), 1)
    h = tl.program_id(0) * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
    dx16 = tl.reshape(tl.broadcast_to(dx[:, None], [BLOCK // 32, 2]), [BLOCK // 16])
    tl.store(sx_ptr + h, sums * dx16, mask=h < K // 16)


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_hn,
    stride_xm,
    stride_om,
    K_PER_SPLIT,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    HALF: tl.constexpr,
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
    C: tl.constexpr = BLOCK_K // 32
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mload = tl.minimum(offs_m, M - 1).to(tl.int64)  # edge tiles re-read the last row/column: unmasked loads
    nload = tl.minimum(offs_n, N - 1).to(tl.int64)
    chunk = tl.arange(0, C)
    lane = tl.arange(0, W)
    q_ptrs = q_ptr + nload[:, None, None] * stride_qn + (chunk[:, None] * W + lane[None, :])[None, :, :]
    h_ptrs = h_ptr + nload[:, None, None] * stride_hn + (chunk[:, None] * NB + lane[None, :] % NB)[None, :, :]
    x_cols = tl.reshape(chunk[:, None] * 32 + lane[None, :], [C * W])  # the inputs of the tile's (low) bytes
    xt_ptrs = x_ptr + mload[None, :] * stride_xm + x_cols[:, None]  # x transposed: [C * W, BLOCK_M]
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    # out transposed: the dequantized weight tile is the dot's left operand, which Hopper's wgmma takes from
    # registers (a right operand would go through shared memory first), and few rows of x fill the narrow side
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # BLOCK_K divides K and K_PER_SPLIT: no K masks
        g = k0 // 32 + chunk
        s_lo, z_lo, s_hi, z_hi = _group_scales(
            d_ptr, sc_ptr, dm_ptr, mn_ptr, nload, g, K, HALF, SUB, HAS_SC, HAS_DM, HAS_MN
        )
        q = tl.load(q_ptrs + k0 // (32 // W))
        h = q
        if HB > 0:
            h = tl.load(h_ptrs + (k0 // 32) * NB)
        lo, hi = _quants(q, h, lane, Q4, HB, NB, OFF)
        xt = tl.load(xt_ptrs + k0)
        lo = lo * s_lo[:, :, None] + z_lo[:, :, None]
        acc = tl.dot(tl.reshape(lo, [BLOCK_N, C * W]).to(xt.dtype), xt, acc)
        if Q4:
            hi = hi * s_hi[:, :, None] + z_hi[:, :, None]
            acc = tl.dot(tl.reshape(hi, [BLOCK_N, C * W]).to(xt.dtype), tl.load(xt_ptrs + k0 + 16), acc)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT > 1:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gguf_dequant_kernel(
    q_ptr,
    d_ptr,
    sc_ptr,
    dm_ptr,
    mn_ptr,
    h_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    stride_hn,
    Q4: tl.constexpr,
    HB: tl.constexpr,
    W: tl.constexpr,
    NB: tl.constexpr,
    HALF: tl.constexpr,
    SUB: tl.constexpr,
    OFF: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_DM: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_K] tile of the weight dequantized (as the GEMM's tiles are) and stored in out's dtype."""
    C: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rload = tl.minimum(rows, N - 1).to(tl.int64)
    chunk = tl.arange(0, C)
    lane = tl.arange(0, W)
    k0 = tl.program_id(1) * BLOCK_K
    g = k0 // 32 + chunk
    s_lo, z_lo, s_hi, z_hi = _group_scales(
        d_ptr, sc_ptr, dm_ptr, mn_ptr, rload, g, K, HALF, SUB, HAS_SC, HAS_DM, HAS_MN
    )
    gmask = (g < K // 32)[None, :, None]
    q_off = (chunk[:, None] * W + lane[None, :])[None, :, :] + k0 // (32 // W)
    q = tl.load(q_ptr + rload[:, None, None] * stride_qn + q_off, mask=gmask, other=0)
    h = q
    if HB > 0:
        h_off = (chunk[:, None] * NB + lane[None, :] % NB)[None, :, :] + (k0 // 32) * NB
        h = tl.load(h_ptr + rload[:, None, None] * stride_hn + h_off, mask=gmask, other=0)
    lo, hi = _quants(q, h, lane, Q4, HB, NB, OFF)
    cols = (k0 + chunk[:, None] * 32 + lane[None, :])[None, :, :]  # the inputs of the (low) bytes
    ptrs = out_ptr + rows.to(tl.int64)[:, None, None] * K + cols
    mask = (rows < N)[:, None, None] & gmask
    dt = out_ptr.dtype.element_ty
    tl.store(ptrs, (lo * s_lo[:, :, None] + z_lo[:, :, None]).to(dt), mask=mask)
    if Q4:
        tl.store(ptrs + 16, (hi * s_hi[:, :, None] + z_hi[:, :, None]).to(dt), mask=mask)


GEMV_ROWS = 8  # the most rows of x the GEMV takes (one read of the weight for all rows)
GEMV_MAX_M = 1  # up to this many rows gguf_matmul takes the GEMV; above, the dequantized weight and cuBLAS

# (BLOCK_N, BLOCK_K, num_warps) of the GEMV; BLOCK_K is capped at K's power of two above (a masked tail step).
# A step reads BLOCK_N * BLOCK_K / 2 bytes of a 4-bit type (16 bytes a thread or more); benchmarks/gguf_gpu.py
# times GEMV_CANDIDATES and prints the best
GEMV_CANDIDATES: list[tuple[int, int, int]] = [(8, 512, 4), (4, 512, 4), (8, 1024, 4), (16, 512, 8), (4, 1024, 4)]
GEMV_DEFAULT = (8, 512, 4)
# layers of at most GEMV_NARROW_N rows: four rows a program, twice the programs (the H200 sweep of the int8 form at one
# row, 7B's layers, 2026-11-27: qkv_proj Q4_K 9.7 us against 10.9 with GEMV_DEFAULT; o_proj and down_proj within 5%
# of their best tile; gate_up_proj's best is GEMV_DEFAULT)
GEMV_NARROW_N, GEMV_NARROW = 8192, (4, 1024, 4)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the row count's bucket (BLOCK_K halved until it divides K)
GEMM_CANDIDATES: dict[int, list[tuple[int, int, int, int, int]]] = {
    32: [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (16, 128, 64, 4, 3)],
    128: [(64, 64, 128, 4, 3), (32, 128, 128, 4, 3), (64, 128, 64, 4, 3)],
    1 << 30: [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3)],
}


def _args(w: GGUFWeight) -> list[torch.Tensor]:
    """The kernels' six weight pointers (an absent array passes d, never read)."""
    return [w.d if t is None else t for t in w.arrays()]


def _consts(w: GGUFWeight) -> dict:
    """The kernels' constexprs for the weight's type (W, NB: bytes of a group of 32 in qweight and in qh)."""
    f = w.fmt
    w_bytes, nb = (16 if f.q4 else 32), (4 * f.hb if f.hb else 1)
    return dict(
        Q4=f.q4,
        HB=f.hb,
        W=w_bytes,
        NB=nb,
        HALF=f.half,
        SUB=f.sub,
        OFF=f.off,
        HAS_SC=f.has_sc,
        HAS_DM=f.has_dm,
        HAS_MN=f.has_mn,
    )


def q8_operands(w: GGUFWeight) -> tuple[list[torch.Tensor], tuple[int, int], dict]:
    """The int8-x GEMV's six weight pointers (quants and high-bit planes as int32 words), the row strides of those
    two in words, and its constexprs (no byte widths); a stack of experts [E, N, ...] passes as its E * N rows."""
    words = [w.qweight.view(torch.int32), *_args(w)[1:5], w.d if w.qh is None else w.qh.view(torch.int32)]
    strides = (w.qweight.stride(-2) // 4, 0 if w.qh is None else w.qh.stride(-2) // 4)
    return words, strides, {c: v for c, v in _consts(w).items() if c not in ("W", "NB")}


Q8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (int8 x, dx per 32 inputs, sx per 16): quantize_q8's


def quantize_q8_reference(x: torch.Tensor) -> Q8:
    """One row x [1, K] (K a multiple of 32) as the one-row GEMV reads it, in torch: int8 round(x / dx), dx = amax /
    127 per 32 inputs, and sx = dx * (the int8 values' sum) per 16."""
    g = x.float().view(-1, 32)
    amax = g.abs().amax(1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.floor(g * inv[:, None] + 0.5)
    dx = amax / 127.0
    sx = q.view(-1, 16).sum(1) * dx.repeat_interleave(2)
    return q.to(torch.int8).view(-1), dx, sx


def quantize_q8(x: torch.Tensor) -> Q8:
    """quantize_q8_reference's result by the Triton kernel (one launch, any device the kernels run on)."""
    k = x.shape[-1]
    xq = torch.empty(k, dtype=torch.int8, device=x.device)
    dx = torch.empty(k // 32, dtype=torch.float32, device=x.device)
    sx = torch.empty(k // 16, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(k))
    _quantize_q8_kernel[(triton.cdiv(k, block),)](x, xq, dx, sx, k, BLOCK=block)
    return xq, dx, sx


def gguf_gemv(
    x: torch.Tensor,
    w: GGUFWeight,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
    q8: Q8 | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_ROWS, unit stride along K) times w^T -> out [M, N] (x's dtype; out may be a column
    slice of a wider output). One row (batch-1 decode) runs on int8 dot products over x quantized per 32 inputs, as
    llama.cpp's CUDA MMVQ does (q8: x already quantized by quantize_q8, shared by a fused layer's parts); more rows
    multiply the float x."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= GEMV_ROWS and x.stride(1) == 1 and k == w.shape[1], (x.shape, w.shape)
    if tiles is None and not x.is_cuda:
        tiles = (4, 64, 4)  # the interpreter: small tiles
    block_n, block_k, warps = tiles or (GEMV_NARROW if n <= GEMV_NARROW_N else GEMV_DEFAULT)
    block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    consts = _consts(w)
    if m == 1:
        xq, dx, sx = q8 if q8 is not None else quantize_q8(x)
        words, strides, q8_consts = q8_operands(w)
        _gguf_gemv_q8_kernel[(triton.cdiv(n, block_n),)](
            xq.view(torch.int32),
            dx,
            sx,
            *words,
            out,
            n,
            k,
            *strides,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            ASM=x.is_cuda,
            num_warps=warps,
            **q8_consts,
        )
        return out
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        *_args(w),
        out,
        m,
        n,
        k,
        w.qweight.stride(0),
        0 if w.qh is None else w.qh.stride(0),
        x.stride(0),
        out.stride(0),
        BLOCK_M=max(2, triton.next_power_of_2(m)),  # one compile per power of two of x's rows
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        **consts,
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
    block_k = max(block_k, 32)
    while k % block_k:  # whole groups dividing K (K is a multiple of the GGML block: 32 or 256)
        block_k //= 2
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split is None:
        split, per_split = split_k(k, tiles_mn, block_k, x.device, programs_per_sm=1)
    else:
        split, per_split = even_split(k, split, block_k)
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
        0 if w.qh is None else w.qh.stride(0),
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


def gguf_dequantize(w: GGUFWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as a dense [N, K] tensor of dtype (out: rows of a wider dense weight), by the Triton kernel."""
    n, k = w.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    block_n, block_k = 8, min(256, triton.next_power_of_2(k))
    _gguf_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        *_args(w),
        out,
        n,
        k,
        w.qweight.stride(0),
        0 if w.qh is None else w.qh.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **_consts(w),
    )
    return out


def gguf_matmul(x: torch.Tensor, parts: list[GGUFWeight]) -> torch.Tensor:
    """x [M, K] times a layer's weight (its parts stacked along N, one GGML type each) -> [M, N] in x's dtype:
    the GEMV up to GEMV_MAX_M rows, else the dequantized weight (a transient copy in x's dtype) and cuBLAS."""
    x = x.contiguous()
    m, n = x.shape[0], sum(p.shape[0] for p in parts)
    if m > GEMV_MAX_M:
        dense = torch.empty((n, x.shape[1]), dtype=x.dtype, device=x.device)
        at = 0
        for p in parts:
            gguf_dequantize(p, x.dtype, dense[at : at + p.shape[0]])
            at += p.shape[0]
        return torch.nn.functional.linear(x, dense)
    q8 = quantize_q8(x) if m == 1 else None  # once for all parts
    if len(parts) == 1:
        return gguf_gemv(x, parts[0], q8=q8)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    at = 0
    for p in parts:
        gguf_gemv(x, p, out[:, at : at + p.shape[0]], q8=q8)
        at += p.shape[0]
    return out

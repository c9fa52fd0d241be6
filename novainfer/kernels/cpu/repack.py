"""Repacks GGUF quantized blocks, without re-quantizing, into the two layouts the CPU kernels read, with the
output rows in panels of 16 (panel_layout.py: the order the kernels' madds consume the weights).

Every supported type dequantizes per group as q * scale + zero, so the repack is exact (scale and zero are
products of GGUF's float16 factors and small integers, formed in float32):
  q4 (4-bit, groups of 32): Q4_0 (scale d, zero -8d), Q4_1 (d, m), Q4_K (d*sc, -dmin*m per 32-sub-block);
  q6 (6-bit, groups of 16): Q6_K (scale d*sc, no zero), a plane of low nibbles and one of signed top 2 bits;
  q8 (int8 container): Q8_0 (groups of 32), Q5_K (groups of 32, with zero), and any merge of different kinds.
Scales and zeros are stored in one of three formats (scale_format; csrc/panel_cpu.h has the bytes):
  SCALE_SUPER, the K-quants: as in the file, an int8 multiplier per group (sc; m for zeros) and a float16 factor
    per super-block of 256 weights (d; -dmin), 16 panel rows side by side. The kernels form factor * multiplier
    in float32 when they load a group, exactly (11 bits times 8), so they use the very values a float32 store
    would hold: Q4_K costs 4.625 bits a weight in memory (file 4.5), Q5_K 8.625 (5.5), Q6_K 6.5625 (the file's).
  SCALE_F16, where every value of the tensor survives float32 -> float16 -> float32 (Q4_0, Q4_1, Q8_0: the
    file's own float16 values, so Q4_1 is 5 bits a weight and Q8_0 8.5, as in the file);
  SCALE_F32 otherwise (and a merge of parts in different formats). The kernels widen float16 exactly, so every
    format gives the same results to the bit; the smaller ones make the decode step read fewer bytes.
MXFP4 (e2m1 codes, an e8m0 exponent per 32) keeps its codes as q4 nibbles (`e2m1`: the kernels read each code
through the table of its doubled values, integers in [-12, 12]) and scale 2^(e - 128), no zero: 4.5 bits a weight
where the exponents fit float16 (2^-24..2^15; any real checkpoint), else 5.
F16 and BF16 (`f16`, `bf16`) are not repacked: their rows stay as stored, [N, K] 16-bit floats, which the C GEMM
(csrc/f16gemm_cpu.c) widens to float32 exactly: a decode step reads 2 bytes a weight, not a float32 copy's 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from novainfer.kernels.cpu import panel_layout
from novainfer.kernels.cpu.panel_layout import SUPER

# type -> (elements per block, bytes per block)
BLOCK = {
    T.Q4_0: (32, 18),
    T.Q4_1: (32, 20),
    T.Q8_0: (32, 34),
    T.Q4_K: (256, 144),
    T.Q5_K: (256, 176),
    T.Q6_K: (256, 210),
    T.MXFP4: (32, 17),
    T.F16: (1, 2),
    T.BF16: (1, 2),
}
SUPPORTED = frozenset(BLOCK)
WIDE = {T.F16: "f16", T.BF16: "bf16"}  # 16-bit float types -> their kind: rows kept as stored, no scales
_WIDE_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
SCALE_F32, SCALE_F16, SCALE_SUPER = 0, 1, 2  # the scale formats (csrc/panel_cpu.h SCALE_*)
_FORMATS = {torch.float32: SCALE_F32, torch.float16: SCALE_F16, torch.uint8: SCALE_SUPER}  # by the scales' dtype
_Scales = np.ndarray | tuple[np.ndarray, np.ndarray]  # row-layout scales: float32, or SCALE_SUPER's (int8, float16)


@dataclass
class PackedWeight:
    """A [N, K] weight in one of the kernels' layouts (see module docstring), output rows in panels of 16
    (panel_layout.py, csrc/panel_cpu.h); tensors on the CPU."""

    kind: str  # "q4", "q6" or "q8"; "f16" or "bf16" (rows as stored, no panels; scales empty, zeros None)
    qweight: torch.Tensor  # q4: uint8 [P, 8K]; q6: uint8 [P, 12K]; q8: int8 [P, 16K] (P = ceil(N / 16) panels);
    # f16 / bf16: float16 / bfloat16 [N, K]
    scales: torch.Tensor  # float16 or float32 [P, 16 * K/group]; SCALE_SUPER: uint8 [P, K/256 * (32 + 16 * 256/group)]
    zeros: torch.Tensor | None  # the scales' shape and dtype; None: all zero
    group: int
    shape: tuple[int, int]
    e2m1: bool = False  # q4 nibbles are MXFP4 codes (E2M1_X2 gives their values), not 0..15

    def __post_init__(self) -> None:
        if self.scales.dtype not in _FORMATS:
            raise ValueError(f"PackedWeight scales must be float16, float32 or uint8, not {self.scales.dtype}")
        if self.zeros is not None and self.zeros.dtype != self.scales.dtype:
            raise ValueError(
                f"PackedWeight zeros ({self.zeros.dtype}) and scales ({self.scales.dtype}) differ in dtype"
            )

    @classmethod
    def from_rows(
        cls,
        kind: str,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        group: int,
        shape: tuple[int, int],
        e2m1: bool = False,
    ) -> "PackedWeight":
        """A weight given in the row layout (q4 uint8 [N, K/2] in GGML's nibble order, q6 and q8 int8 [N, K]; scales
        and zeros float [N, K/group])."""
        t, zp = torch.from_numpy, None if zeros is None else panel_layout.groups_to_panels(zeros.numpy())
        return cls(
            kind,
            t(panel_layout.quants_to_panels(kind, q.numpy())),
            t(panel_layout.groups_to_panels(scales.numpy())),
            None if zp is None else t(zp),
            group,
            shape,
            e2m1,
        )

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(quants, scales, zeros) in the row layout of from_rows (copies; SCALE_SUPER's values as float32)."""
        n, k = self.shape
        t = torch.from_numpy
        z = None if self.zeros is None else t(panel_layout.groups_to_rows(self._values(self.zeros), n))
        return (
            t(panel_layout.quants_to_rows(self.kind, self.qweight.numpy(), n, k)),
            t(panel_layout.groups_to_rows(self._values(self.scales), n)),
            z,
        )

    @property
    def quant_code(self) -> int:
        """The kernels' QUANT_* code of the quants' layout (csrc/panel_cpu.h)."""
        return panel_layout.QUANT_E2M1 if self.e2m1 else panel_layout.QUANT[self.kind]

    @property
    def scale_format(self) -> int:
        """SCALE_F32, SCALE_F16 or SCALE_SUPER: how scales and zeros are stored (the kernels' scale_fmt)."""
        return _FORMATS[self.scales.dtype]

    def _values(self, t: torch.Tensor) -> np.ndarray:
        """Scales or zeros as float values [P, 16 * K/group] (SCALE_SUPER's products formed in float32)."""
        if t.dtype != torch.uint8:
            return t.numpy()
        return panel_layout.superblocks_to_groups(t.numpy(), self.shape[1] // SUPER)

    def float32_scales(self) -> "PackedWeight":
        """The same weight with float32 scales and zeros (merge_rows of mixed parts; the tests' reference)."""
        z = None if self.zeros is None else torch.from_numpy(self._values(self.zeros)).float()
        s = torch.from_numpy(self._values(self.scales)).float()
        return PackedWeight(self.kind, self.qweight, s, z, self.group, self.shape, self.e2m1)

    def nbytes(self) -> int:
        """Bytes of quants, scales and zeros: what one pass over the weight reads."""
        z = 0 if self.zeros is None else self.zeros.nbytes
        return self.qweight.nbytes + self.scales.nbytes + z

    @property
    def wide(self) -> bool:
        """Whether this is a 16-bit float weight kept as stored (kind f16 or bf16)."""
        return self.kind in _WIDE_DTYPES

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight in torch (fallback paths and the tests' reference for the C kernels)."""
        if self.wide:
            return self.qweight.float()
        n, k = self.shape
        q, scales, zeros = self.rows()
        if self.kind == "q4":
            vals = torch.from_numpy(panel_layout.q4_values(q.numpy())).view(n, k // 32, 32)
            vals = (E2M1_X2[vals.long()] if self.e2m1 else vals).float()
        else:
            vals = q.float().view(n, k // self.group, self.group)
        out = vals * scales.float().unsqueeze(-1)
        if zeros is not None:
            out += zeros.float().unsqueeze(-1)
        return out.view(n, k)


def _halves(b: np.ndarray) -> np.ndarray:
    """[n, blocks, 2] bytes -> the float16 values [n, blocks]."""
    return np.ascontiguousarray(b).view(np.float16).reshape(b.shape[:2])


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, blocks, 2] bytes -> the float16 values as float32 [n, blocks]."""
    return _halves(b).astype(np.float32)


def _q4_k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K's 32 bytes per 64 elements (element j low nibble of byte j, j+32 high) -> two groups of 32 in
    the q4 layout, byte to byte (no unpack to values and pack again)."""
    a, c = qs[..., 0, :16], qs[..., 0, 16:]
    out = np.empty(qs.shape[:-2] + (2, 16), np.uint8)
    np.left_shift(c, 4, out=out[..., 0, :])  # the first group: element i | element i+16 << 4
    out[..., 0, :] |= a & 0xF
    np.right_shift(a, 4, out=out[..., 1, :])  # the second group: the high nibbles
    out[..., 1, :] |= c & 0xF0
    return out


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block, uint8 (ggml get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


E2M1_X2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)  # csrc/panel_cpu.h


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's exponent bytes -> 2^(e - 128) in float32 (ggml's half scale, for the doubled e2m1 values)."""
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An HF MXFP4 weight (blocks uint8 [..., K/32, 16], element 2j the low nibble of byte j, 2j + 1 the high;
    scales uint8 [..., K/32]) -> GGUF's block_mxfp4 bytes uint8 [..., K/32 * 17] (the exponent, then element i
    low and i + 16 high in byte i): the same weights, the layout repack() takes."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., K/32, 32] in element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2)


# type -> (kind, group, has zero points) of the layout it repacks into
LAYOUT = {
    T.Q4_0: ("q4", 32, True),
    T.Q4_1: ("q4", 32, True),
    T.Q8_0: ("q8", 32, False),
    T.Q4_K: ("q4", 32, True),
    T.Q5_K: ("q8", 32, True),
    T.Q6_K: ("q6", 16, False),
    T.MXFP4: ("q4", 32, False),
}
CHUNK_BYTES = 1 << 22  # GGUF bytes repacked at a time: the numpy temporaries stay a few times this, not the tensor


def repack(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> PackedWeight:
    """GGUF blocks of a [N, K] weight (uint8 [N, bytes per row]) -> PackedWeight, exactly.

    Rows go CHUNK_BYTES at a time into the preallocated layout (a 152k-row lm_head would otherwise take
    several GB of int16 temporaries)."""
    n, k = shape
    if qtype in WIDE:
        return _wide(data, qtype, shape)
    if qtype not in BLOCK:
        raise ValueError(f"no repack for GGUF type {qtype.name}")
    per, nbytes = BLOCK[qtype]
    if k % per:
        raise ValueError(f"row length {k} is not a multiple of {qtype.name}'s block of {per}")
    b = np.asarray(data, dtype=np.uint8).reshape(n, k // per, nbytes)
    kind, group, has_zero = LAYOUT[qtype]
    p, pn = panel_layout.num_panels(n), panel_layout.PANEL
    qweight = np.empty((p, panel_layout.PANEL_BYTES[kind] * k), np.int8 if kind == "q8" else np.uint8)
    scales = zeros = None
    step = max(1, CHUNK_BYTES // (k // per * nbytes) // pn) * pn  # whole panels at a time
    for r in range(0, n, step):
        q, sc, zero = _repack_blocks(b[r : r + step], qtype)
        at = slice(r // pn, (r + q.shape[0] + pn - 1) // pn)
        qweight[at] = panel_layout.quants_to_panels(kind, q)
        sc = _scale_panels(sc)
        if scales is None:  # the format's width, from the first chunk
            scales = np.empty((p, sc.shape[1]), sc.dtype)
            zeros = np.empty_like(scales) if has_zero else None
        scales[at] = sc
        if zeros is not None:
            zeros[at] = _scale_panels(zero)
    if scales.dtype == np.float32:
        scales, zeros = _narrow(scales, zeros)
    t = torch.from_numpy
    z = None if zeros is None else t(zeros)
    return PackedWeight(kind, t(qweight), t(scales), z, group, shape, qtype == T.MXFP4)


def _wide(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> PackedWeight:
    """F16 or BF16 rows (uint8 [N, 2K], or any 16-bit array of the values) -> their PackedWeight: the same bits,
    viewed as 16-bit floats."""
    kind = WIDE[qtype]
    bits = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).reshape(shape))
    return PackedWeight(kind, bits.view(_WIDE_DTYPES[kind]), torch.empty(0), None, 1, shape)


def _scale_panels(s: _Scales) -> np.ndarray:
    """Row-layout scales or zeros -> the panel layout: float32 [N, ng], or SCALE_SUPER's (multipliers, factors)."""
    return panel_layout.superblocks_to_panels(*s) if isinstance(s, tuple) else panel_layout.groups_to_panels(s)


def _narrow(scales: np.ndarray, zeros: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Both as float16 when every value round-trips through float16 exactly (and is finite), else as they are."""
    with np.errstate(over="ignore"):  # an overflow gives inf, which keeps the tensor float32
        halves = [None if a is None else a.astype(np.float16) for a in (scales, zeros)]
    for a, h in zip((scales, zeros), halves):
        if a is not None and not (np.isfinite(h).all() and np.array_equal(h.astype(np.float32), a)):
            return scales, zeros
    return halves[0], halves[1]


def _repack_blocks(b: np.ndarray, qtype: T) -> tuple[np.ndarray, _Scales, _Scales | None]:
    """uint8 [n, blocks, bytes per block] -> (quants, scales, zeros or None) of the type's LAYOUT; the K-quants'
    scales and zeros as SCALE_SUPER's (int8 multipliers [n, groups], float16 factors [n, blocks])."""
    n = b.shape[0]
    k = b.shape[1] * BLOCK[qtype][0]
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(b[..., 0:2])
        if qtype == T.Q4_0:
            zero, qs = -8 * d, b[..., 2:18]
        else:
            zero, qs = _f16(b[..., 2:4]), b[..., 4:20]
        return qs.reshape(n, k // 2), d, zero
    if qtype == T.MXFP4:
        return b[..., 1:17].reshape(n, k // 2), e8m0_half(b[..., 0]), None
    if qtype == T.Q8_0:
        return b[..., 2:34].view(np.int8).reshape(n, k), _f16(b[..., 0:2]), None
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _halves(b[..., 0:2]), _halves(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        scales, zeros = (sc.reshape(n, -1).view(np.int8), d), (mn.reshape(n, -1).view(np.int8), -dmin)
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32)  # 4 chunks of 64 elements: low nibbles, then high
        if qtype == T.Q4_K:
            return _q4_k_nibbles(qs).reshape(n, k // 2), scales, zeros
        vals = np.concatenate([qs & 0xF, qs >> 4], axis=3)  # [n, blocks, 4, 2, 32]
        qh = b[..., 16:48].reshape(n, -1, 1, 1, 32)
        bit = np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)
        vals = vals | (((qh >> bit) & 1) << 4)
        return vals.reshape(n, k).view(np.int8), scales, zeros  # values 0..31
    ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)  # Q6_K
    sc = b[..., 192:208].view(np.int8).reshape(n, -1)
    low = np.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # [n, blocks, 2, 4, 32]
    vals = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    return vals.reshape(n, k).astype(np.int8), (sc, _halves(b[..., 208:210])), None


def merge_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights along N (fused q/k/v or gate/up). Mixed kinds go to the q8 container, exactly; 16-bit float
    weights stack only with their own kind (ValueError otherwise: callers check mergeable())."""
    k = parts[0].shape[1]
    if any(p.wide for p in parts):
        if len({p.kind for p in parts}) > 1:
            raise ValueError(f"cannot stack {sorted({p.kind for p in parts})} weights exactly")
        qweight = torch.cat([p.qweight for p in parts])
        return PackedWeight(parts[0].kind, qweight, torch.empty(0), None, 1, (qweight.shape[0], k))
    if len({(p.kind, p.group, p.e2m1) for p in parts}) > 1:
        group = min(p.group for p in parts)
        parts = [_as_q8(p, group) for p in parts]
    if len({p.scale_format for p in parts}) > 1:
        parts = [p.float32_scales() for p in parts]
    first, n = parts[0], sum(p.shape[0] for p in parts)
    has_zeros = any(p.zeros is not None for p in parts)

    def zeros_of(p: PackedWeight, z: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
        return z if z is not None else torch.zeros_like(s)

    if all(p.shape[0] % panel_layout.PANEL == 0 for p in parts):  # whole panels: they stack as they are
        zeros = torch.cat([zeros_of(p, p.zeros, p.scales) for p in parts]) if has_zeros else None
        return PackedWeight(
            first.kind,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            zeros,
            first.group,
            (n, k),
            first.e2m1,
        )
    rows = [p.rows() for p in parts]
    zeros = torch.cat([zeros_of(p, z, s) for p, (_, s, z) in zip(parts, rows)]) if has_zeros else None
    quants, scales = torch.cat([q for q, _, _ in rows]), torch.cat([s for _, s, _ in rows])
    return PackedWeight.from_rows(first.kind, quants, scales, zeros, first.group, (n, k), first.e2m1)


def mergeable(qtypes: list[T]) -> bool:
    """Whether merge_rows stacks weights of these types: all quantized ones, or all one 16-bit float type."""
    return len(set(qtypes)) == 1 or not any(t in WIDE for t in qtypes)


def _as_q8(p: PackedWeight, group: int) -> PackedWeight:
    """The same weight in the int8 container with groups of `group` (a divisor of p.group), in p's scale format."""
    n, k = p.shape
    q = torch.from_numpy(panel_layout.quants_to_rows(p.kind, p.qweight.numpy(), n, k))
    if p.kind == "q4":
        q = torch.from_numpy(panel_layout.q4_values(q.numpy()))
        q = E2M1_X2[q.long()] if p.e2m1 else q.to(torch.int8)
    rep = p.group // group
    if p.scale_format == SCALE_SUPER:  # each group's multipliers rep times; the factors stay

        def regroup(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.from_numpy(panel_layout.superblocks_repeat(t.numpy(), k // SUPER, rep))

        qweight = torch.from_numpy(panel_layout.quants_to_panels("q8", q.numpy()))
        return PackedWeight("q8", qweight, regroup(p.scales), regroup(p.zeros), group, p.shape)
    scales, zeros = (
        None if t is None else torch.from_numpy(panel_layout.groups_to_rows(t.numpy(), n)) for t in (p.scales, p.zeros)
    )
    zeros = None if zeros is None else zeros.repeat_interleave(rep, dim=1)
    return PackedWeight.from_rows("q8", q, scales.repeat_interleave(rep, dim=1), zeros, group, p.shape)

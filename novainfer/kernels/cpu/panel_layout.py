"""Row-major quants and scales <-> the panel layout the CPU kernels read (csrc/panel_cpu.h says byte by byte).

Output rows go in panels of 16, and each panel's weights in the order the GEMM's int16 madds consume them, so a
kernel unpacks them in registers with shifts and masks (no transposes, no scratch) and streams each panel as one
contiguous run of memory. The row layout is the one GGUF blocks repack into (repack.py): q4 uint8 [N, K/2]
with GGML's nibble order per group of 32 (byte j: element j low, j + 16 high), q8 and q6 int8 [N, K] (q6: -32..31,
stored as 6-bit two's complement: the low nibbles in the q4 layout, a plane of the top 2 bits); scales and zeros
[N, K/G]. Both directions are exact (a permutation of values); padding rows past N are zero. The K-quants' scales
and zeros go as int8 multipliers [N, K/G] of float16 factors [N, K/256] (superblocks_to_panels).
"""

from __future__ import annotations

import numpy as np

from novainfer.kernels.cpu import library

PANEL = 16  # output rows a panel (csrc/panel_cpu.h)
PANEL_BYTES = {"q4": 8, "q6": 12, "q8": 16}  # bytes a panel takes per element of K
QUANT = {"q8": 0, "q4": 1, "q6": 3, "f16": 4, "bf16": 5}  # the kernels' code of each layout (csrc/panel_cpu.h
# QUANT_*; f16 and bf16 are rows as stored, not panels)
QUANT_E2M1 = 2  # q4 nibbles read as MXFP4 codes
SUPER = 256  # weights a K-quant super-block: one float16 factor per row (csrc/panel_cpu.h SCALE_SUPER)


def num_panels(n: int) -> int:
    """Panels of an N-row weight."""
    return -(-n // PANEL)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], a.dtype)
    out[: a.shape[0]] = a
    return out


def q4_values(q: np.ndarray) -> np.ndarray:
    """Row-layout q4 bytes [N, K/2] -> their 4-bit values, uint8 [N, K] in element order."""
    n, k = q.shape[0], q.shape[1] * 2
    g = q.reshape(n, k // 32, 1, 16)
    return np.concatenate([g & 15, g >> 4], axis=2).reshape(n, k)  # low nibbles: elements 0-15, high: 16-31


def q4_rows_bytes(vals: np.ndarray) -> np.ndarray:
    """uint8 values [N, K] (0..15) -> row-layout q4 bytes [N, K/2] (the inverse of q4_values)."""
    n, k = vals.shape
    g = vals.reshape(n, k // 32, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def quants_to_panels(kind: str, q: np.ndarray, fast: bool = True) -> np.ndarray:
    """Row-layout quants [N, ...] -> the panel layout: q4 uint8 [P, 8K], q6 uint8 [P, 12K], q8 int8 [P, 16K]. fast:
    in C (csrc/repack_panels_cpu.c) where the CPU kernels are built, else (and as the reference) in numpy."""
    lib = library.library() if fast and library.available() else None
    if lib is not None:
        n, k = q.shape[0], q.shape[1] * (2 if kind == "q4" else 1)
        q = np.ascontiguousarray(q)
        out = np.empty((num_panels(n), PANEL_BYTES[kind] * k), np.int8 if kind == "q8" else np.uint8)
        if n:
            lib.repack_panels(q.ctypes.data, QUANT[kind], n, k, out.ctypes.data, library.num_threads())
        return out
    if kind == "q6":  # per 8 elements: q4's 64 bytes of the low nibbles, then 32 of the top 2 bits (q's 6-bit form)
        n, k = q.shape
        p = num_panels(n)
        u = (_pad_rows(q, p * PANEL).astype(np.int16) + 32).astype(np.uint8)  # padding rows: weights 0
        lo = quants_to_panels("q4", q4_rows_bytes(u & 15), fast=False).reshape(p, k // 8, 64)
        # [P, half h, row i, quad c, k-pair s, element e]; vector t = 2s + h's bits go to bits 2t of byte (c, lane)
        v = ((u >> 4) ^ 2).reshape(p, 2, 8, k // 4, 2, 2)  # the top 2 bits: (u >> 4) - 2 in two's complement
        hi = v[:, 0, :, :, 0] | v[:, 1, :, :, 0] << 2 | v[:, 0, :, :, 1] << 4 | v[:, 1, :, :, 1] << 6  # [P, i, c, e]
        hi = hi.transpose(0, 2, 1, 3).reshape(p, k // 8, 32)
        return np.concatenate([lo, hi], axis=2).reshape(p, 12 * k)
    if kind == "q4":
        vals = q4_values(q)
        n, k = vals.shape
        p = num_panels(n)
        # [P, half h, row i, quad c, k-pair s, element e]; nibble t = 2s + h of lane (i, e) is bits 4h.. of its byte s
        v = _pad_rows(vals, p * PANEL).reshape(p, 2, 8, k // 4, 2, 2)
        b = v[:, 0] | (v[:, 1] << 4)  # [P, i, c, s, e]
        return np.ascontiguousarray(b.transpose(0, 2, 1, 4, 3)).reshape(p, 8 * k)  # [P, c, lane (i, e), byte s]
    n, k = q.shape
    p = num_panels(n)
    # [P, half h, row i, k-pair, element e] -> [P, k-pair, lane (i, e), byte h]
    v = _pad_rows(q, p * PANEL).reshape(p, 2, 8, k // 2, 2).transpose(0, 3, 2, 4, 1)
    return np.ascontiguousarray(v).reshape(p, 16 * k)


def quants_to_rows(kind: str, panels: np.ndarray, n: int, k: int) -> np.ndarray:
    """The inverse of quants_to_panels: row-layout quants of the first n rows."""
    p = panels.shape[0]
    if kind == "q6":
        b = panels.reshape(p, k // 8, 96)
        lo = q4_values(quants_to_rows("q4", np.ascontiguousarray(b[:, :, :64]).reshape(p, 8 * k), p * PANEL, k))
        bits = b[:, :, 64:].reshape(p, k // 4, 8, 2)  # [P, c, i, e]
        t = np.stack([(bits >> (2 * t)) & 3 for t in range(4)], axis=-1).reshape(p, k // 4, 8, 2, 2, 2)  # t = 2s + h
        hi = t.transpose(0, 5, 2, 1, 4, 3).reshape(p * PANEL, k) ^ 2  # [P, h, i, c, s, e]: u >> 4
        return ((lo | hi << 4).astype(np.int16) - 32).astype(np.int8)[:n]
    if kind == "q4":
        lanes = np.ascontiguousarray(panels).view(np.uint16).reshape(p, k // 4, 16)
        v = np.stack([(lanes >> (4 * t)) & 15 for t in range(4)], axis=-1).astype(np.uint8)  # [P, c, lane, t]
        v = v.reshape(p, k // 4, 8, 2, 2, 2).transpose(0, 5, 2, 1, 4, 3)  # t = 2s + h -> [P, h, i, c, s, e]
        return q4_rows_bytes(v.reshape(p * PANEL, k)[:n])
    v = panels.reshape(p, k // 2, 8, 2, 2).transpose(0, 4, 2, 1, 3)  # [P, h, i, k-pair, e]
    return np.ascontiguousarray(v).reshape(p * PANEL, k)[:n]


def groups_to_panels(a: np.ndarray) -> np.ndarray:
    """Scales or zeros [N, ng] -> [P, 16 * ng] (group g's 16 rows side by side)."""
    n, ng = a.shape
    p = num_panels(n)
    return np.ascontiguousarray(_pad_rows(a, p * PANEL).reshape(p, PANEL, ng).transpose(0, 2, 1)).reshape(p, -1)


def groups_to_rows(a: np.ndarray, n: int) -> np.ndarray:
    """The inverse of groups_to_panels: [n, ng]."""
    p = a.shape[0]
    return np.ascontiguousarray(a.reshape(p, -1, PANEL).transpose(0, 2, 1)).reshape(p * PANEL, -1)[:n]


def superblocks_to_panels(multipliers: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """K-quant scales (or zeros) as int8 multipliers [N, ng] of float16 factors [N, K/256] -> uint8
    [P, K/256 * (32 + 16 * gps)]: per super-block its 16 rows' factors, then its gps groups' 16 multipliers each."""
    p, nsb = num_panels(multipliers.shape[0]), factors.shape[1]
    f = groups_to_panels(factors.astype(np.float16)).view(np.uint8).reshape(p, nsb, 2 * PANEL)
    m = groups_to_panels(multipliers.astype(np.int8)).view(np.uint8).reshape(p, nsb, -1)
    return np.concatenate([f, m], axis=2).reshape(p, -1)


def superblocks_split(a: np.ndarray, nsb: int) -> tuple[np.ndarray, np.ndarray]:
    """superblocks_to_panels' output -> (factors float16 [P, nsb, 1, 16], multipliers int8 [P, nsb, gps, 16])."""
    b = np.ascontiguousarray(a).reshape(a.shape[0], nsb, -1)
    f = np.ascontiguousarray(b[:, :, : 2 * PANEL]).view(np.float16)[:, :, None, :]
    return f, np.ascontiguousarray(b[:, :, 2 * PANEL :]).view(np.int8).reshape(a.shape[0], nsb, -1, PANEL)


def superblocks_to_groups(a: np.ndarray, nsb: int) -> np.ndarray:
    """superblocks_to_panels' output -> the float32 values in groups_to_panels' layout [P, 16 * ng]: factor *
    multiplier in float32, exact (11 bits times 8), as the kernels form them."""
    f, m = superblocks_split(a, nsb)
    return (f.astype(np.float32) * m.astype(np.float32)).reshape(a.shape[0], -1)


def superblocks_repeat(a: np.ndarray, nsb: int, rep: int) -> np.ndarray:
    """superblocks_to_panels' output with every group split into rep groups of the same multiplier (the int8
    container's smaller groups)."""
    f, m = superblocks_split(a, nsb)
    m = np.repeat(m, rep, axis=2).view(np.uint8).reshape(a.shape[0], nsb, -1)
    return np.concatenate([f[:, :, 0].view(np.uint8), m], axis=2).reshape(a.shape[0], -1)

"""GGUF blocks rearranged, without re-quantizing, into kernels/gguf_gemm.py's split GPU layout (low nibbles, high-bit
planes, block factors and sub-scales in separate contiguous arrays, each type about its file size): the dense
layers' method (gguf_gpu.py) and the MoE experts' (gguf_moe.py) both load through it."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from novainfer.kernels.cpu.repack import BLOCK
from novainfer.kernels.gguf_gemm import FORMATS, GGUFWeight, pack_nibbles

GPU_TYPES = frozenset(T[name] for name in FORMATS)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes a block [n, blocks, 2] -> float16 [n, blocks] (as stored: exact)."""
    return b.contiguous().view(torch.float16).view(b.shape[0], -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes a super-block -> its eight 6-bit scales and eight 6-bit mins, uint8 [n, blocks * 8]
    (ggml's get_scale_min_k4)."""
    lo_sc, lo_mn, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)], dim=-1)
    mn = torch.cat([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], dim=-1)
    return sc.reshape(s.shape[0], -1), mn.reshape(s.shape[0], -1)


def _repack(b: torch.Tensor, qtype: T) -> tuple[torch.Tensor | None, ...]:
    """GGUF blocks uint8 [n, blocks, bytes per block] -> the GPU layout's arrays (kernels/gguf_gemm.py ARRAYS)."""
    n, k = b.shape[0], b.shape[1] * BLOCK[qtype][0]
    if qtype in (T.Q4_0, T.Q4_1):
        q = b[..., 2:18] if qtype == T.Q4_0 else b[..., 4:20]  # byte i: input i low, i + 16 high (the layout's)
        dm = _f16(b[..., 2:4]) if qtype == T.Q4_1 else None
        return q.reshape(n, k // 2), _f16(b[..., 0:2]), None, dm, None, None
    if qtype == T.Q8_0:
        return b[..., 2:34].contiguous().view(torch.int8).reshape(n, k), _f16(b[..., 0:2]), None, None, None, None
    if qtype in (T.Q4_K, T.Q5_K):
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32)  # four 64-input chunks: inputs 0..31 low nibbles, 32..63 high
        v = torch.cat([qs & 15, qs >> 4], dim=3)  # [n, blocks, 4, 2, 32] in input order
        if qtype == T.Q5_K:  # bit 2j (2j + 1) of qh[l] is the fifth bit of chunk j's low (high) nibble l
            qh = b[..., 16:48].reshape(n, -1, 1, 1, 32)
            shift = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 1, 4, 2, 1)
            v |= ((qh >> shift) & 1) << 4
        q, planes = pack_nibbles(v.reshape(n, k), 1 if qtype == T.Q5_K else 0)
        return q, _f16(b[..., 0:2]), sc, -_f16(b[..., 2:4]), mn, planes
    # Q6_K: two halves of 128 inputs; l < 32 of a half: ql[l], ql[l + 32] give inputs l, l + 32 (low nibbles) and
    # l + 64, l + 96 (high), with two high bits each from qh[l] at bits 0, 2, 4, 6 (stored 0..63, offset 32)
    ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
    nib = [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    v = torch.stack([x | (((qh >> (2 * i)) & 3) << 4) for i, x in enumerate(nib)], dim=3)
    q, planes = pack_nibbles(v.reshape(n, k), 2)
    return q, _f16(b[..., 208:210]), b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1), None, None, planes


CHUNK_BYTES = 64 << 20  # GGUF bytes repacked at a time: the temporaries stay a few times this, not the tensor


def gpu_layout(data: np.ndarray, qtype: T, shape: tuple[int, int], device: torch.device) -> GGUFWeight:
    """GGUF blocks of a [N, K] weight (uint8 [N, bytes per row]) -> the GPU layout on device, exactly (the bytes
    go to the device as they are and are rearranged there, CHUNK_BYTES of rows at a time)."""
    n, k = shape
    per, nbytes = BLOCK[qtype]
    if k % per:
        raise ValueError(f"row length {k} is not a multiple of {qtype.name}'s block of {per}")
    raw = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).view(n, k // per, nbytes)
    step = max(1, CHUNK_BYTES // (k // per * nbytes))
    chunks = [_repack(raw[r : r + step].to(device), qtype) for r in range(0, n, step)]
    parts = [None if c[0] is None else torch.cat(list(c)) if len(c) > 1 else c[0] for c in zip(*chunks)]
    return GGUFWeight(qtype.name, *parts, shape)

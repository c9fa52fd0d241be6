"""Attention over the paged KV cache in Triton: a decode kernel and a prefill kernel.

Both read keys and values through each sequence's block table, so a cached prefix costs nothing to
re-use, and both keep the softmax online in float32 (flash-attention style).

- decode: one new token per sequence. A program takes one sequence, one KV head and one split of the
  context, and computes all the query heads of that KV head's group at once, so each K/V tile is read
  once per group (GQA). With several splits (split-K, for long contexts and small batches) each writes
  an unnormalised partial result, and the last split of a sequence and KV head to finish (counted on an
  atomic) merges them in the same launch. With rope= it also rotates q and the new key and stores the new
  key and value itself (the batch-1 decode stack, worker/gpu_decode_stack.py).
- prefill: any number of new tokens per sequence, after any number of cached ones (chunked prefill,
  prefix-cache hits). A program takes BLOCK_M query tokens of one head and walks the visible keys.

Both honour a per-layer sliding window (a query at p sees keys k with p - window < k <= p: the loops
start at the window's first tile, so a long context costs only the window), logit soft-capping
(cap * tanh(score / cap) before the softmax, Gemma 2) and attention sinks (one logit per head that joins the
softmax's normalizer and emits nothing, gpt-oss: folded in once the keys are done). The torch reference is
attention/torch_backend.py.

An fp8 (e4m3) cache is read widened to the query's dtype (float16 for a 16-bit query: see _fp8_query); its layer's
k_scale is folded into the softmax scale and its v_scale into the output (the values were stored divided by them,
kernels/kv_store.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from novainfer.kernels import batch_invariant
from novainfer.kernels.fused_ops import rope_mix
from novainfer.kernels.kv_fp8 import is_fp8
from novainfer.kernels.kv_store import to_cache


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    bt_stride,
    seq,
    kvh,
    pos,
    pmask,
    d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    blk = tl.load(block_tables_ptr + seq * bt_stride + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
    offs = (slot * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=pmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=pmask[:, None], other=0.0)
    return k, v


@triton.jit
def _fp8_query(q, scale):
    """A 16-bit query against an fp8 cache, as float16 scaled into [-1, 1] per row, and the score scale per row.

    e4m3 widens to float16 in one instruction (to bfloat16 in several), so the products run in float16; each row's
    largest |q| is divided out (and multiplied back into the scale), so no query overflows float16's range."""
    qf = q.to(tl.float32)
    qmax = tl.max(tl.abs(qf), 1)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    return (qf / qmax[:, None]).to(tl.float16), scale * qmax[:, None]


@triton.jit
def _attend_tile(q, k, v, valid, m, l, acc, scale, soft_cap, HAS_SOFT_CAP: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step: fold a K/V tile into the running max m, sum l and output acc (float32).

    A row that has seen no visible key yet (a window's edge) keeps m = -inf, l = 0 and acc = 0. K/V stored narrower
    (fp8) are widened to q's dtype. scale is a scalar or one per row ([rows, 1])."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
    if HAS_SOFT_CAP:  # cap * tanh(s / cap), tanh written with exp (saturates to +-1 without overflow)
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _fold_sink(m, l, acc, sink):
    """The running (m, l, acc) with one more logit, the sink, in the normalizer and nothing in the output."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    return m_new, l * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


# a block table's width changes from step to step: specializing on it (divisible by 16 or not) compiled a second
# variant of each kernel during a fresh machine's first timed run (benchmarks/triton_compiles.py)
@triton.jit(do_not_specialize=["bt_stride"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    counter_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    sinks_ptr,
    scale,
    k_scale,
    v_scale,
    window,
    soft_cap,
    q_stride_t,
    q_stride_h,
    kv_new_stride,
    bt_stride,
    o_stride_t,
    o_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    ROPE: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0  # the query sits at seq_len - 1
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    # this context's splits: at most NUM_SPLITS, each at least SPLIT_TILES tiles; the programs past them idle
    tiles = tl.maximum(num_tiles - first_tile, 1)
    tiles_per_split = tl.cdiv(tiles, tl.minimum(tl.cdiv(tiles, SPLIT_TILES), NUM_SPLITS))
    used = tl.cdiv(tiles, tiles_per_split)
    if split < used:
        g = tl.arange(0, GROUP_PAD)
        gmask = g < GROUP
        heads = kvh * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=gmask[:, None], other=0.0)
        if ROPE:  # rotate q here; the split holding the newest key rotates it and stores it and its value
            q = _rope_rows(
                q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h,
                q,
                gmask[:, None],
                pos_ptr + seq,
                cos_ptr,
                sin_ptr,
                d[None, :],
                HEAD_DIM,
            )
            if split == used - 1:
                kv_off = seq * kv_new_stride + kvh * HEAD_DIM + d
                k_new = tl.load(k_new_ptr + kv_off)
                k_new = _rope_rows(
                    k_new_ptr + seq * kv_new_stride + kvh * HEAD_DIM,
                    k_new,
                    d >= 0,
                    pos_ptr + seq,
                    cos_ptr,
                    sin_ptr,
                    d,
                    HEAD_DIM,
                )
                slot = tl.load(slot_ptr + seq).to(tl.int64)
                cache_off = (slot * NUM_KV_HEADS + kvh) * HEAD_DIM + d
                smask = d < tl.where(slot >= 0, HEAD_DIM, 0)  # a padding row (slot -1) writes nothing
                tl.store(k_cache_ptr + cache_off, to_cache(k_new, k_scale, k_cache_ptr, FP8), mask=smask)
                v_new = to_cache(tl.load(v_new_ptr + kv_off), v_scale, v_cache_ptr, FP8)
                tl.store(v_cache_ptr + cache_off, v_new, mask=smask)
                tl.debug_barrier()  # the stores are seen by this program's threads reading the last tile

        if FP8 and q_ptr.dtype.element_ty != tl.float32:
            q, qk_scale = _fp8_query(q, scale)
        else:
            qk_scale = scale
        tile_start = first_tile + split * tiles_per_split
        tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for t in range(tile_start, tile_end):
            pos = t * BLOCK_N + n
            pmask = (pos < seq_len) & (pos >= kv_start)
            k, v = _load_kv_tile(
                k_cache_ptr,
                v_cache_ptr,
                block_tables_ptr,
                bt_stride,
                seq,
                kvh,
                pos,
                pmask,
                d,
                NUM_KV_HEADS,
                HEAD_DIM,
                BLOCK_SIZE,
            )
            m, l, acc = _attend_tile(q, k, v, pmask[None, :], m, l, acc, qk_scale, soft_cap, HAS_SOFT_CAP, PRECISION)

        o_ptrs = out_ptr + seq * o_stride_t + heads[:, None] * o_stride_h + d[None, :]
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=gmask, other=0.0).to(tl.float32)
        else:
            sink = tl.zeros([GROUP_PAD], tl.float32)
        if used == 1:
            if HAS_SINKS:
                m, l, acc = _fold_sink(m, l, acc, sink)
            tl.store(o_ptrs, (acc / l[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        else:  # write this split's partial result; the last split of (seq, kvh) to finish merges them all
            row = (seq * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS  # [GROUP_PAD] first partial row of each head
            tl.store(part_acc_ptr + (row + split)[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
            tl.store(part_ml_ptr + (row + split) * 2, m, mask=gmask)
            tl.store(part_ml_ptr + (row + split) * 2 + 1, l, mask=gmask)
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + seq * NUM_KV_HEADS + kvh, 1, sem="acq_rel", scope="gpu")
            if done == used - 1:
                tl.store(counter_ptr + seq * NUM_KV_HEADS + kvh, 0)  # ready for the next layer's launch
                out = _merge_splits(
                    part_acc_ptr, part_ml_ptr, row, gmask, used, d, sink, NUM_SPLITS, HEAD_DIM, HAS_SINKS
                )
                tl.store(o_ptrs, (out * v_scale).to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _rope_rows(x_ptr, x, mask, pos_ptr, cos_ptr, sin_ptr, d, HEAD_DIM: tl.constexpr):
    """Neox rotary of rows x (loaded from x_ptr + d under mask) at the position pos_ptr holds, rounded as
    fused_ops' rotary kernel rounds it."""
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr).to(tl.int64)
    partner = tl.load(x_ptr + (d + half) % HEAD_DIM, mask=mask, other=0.0)  # rotate_half: (-x2, x1)
    x_rot = tl.where(d < half, -partner, partner)
    return rope_mix(x, tl.load(cos_ptr + pos * HEAD_DIM + d), x_rot, tl.load(sin_ptr + pos * HEAD_DIM + d))


@triton.jit
def _merge_splits(
    part_acc_ptr,
    part_ml_ptr,
    row,
    gmask,
    used,
    d,
    sink,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """The softmax-weighted sum of the used splits' partial results for each head's rows (loads bypass L1:
    other programs wrote them); with HAS_SINKS each head's sink logit joins the normalizer."""
    s = tl.arange(0, NUM_SPLITS)
    ml = part_ml_ptr + (row[:, None] + s[None, :]) * 2
    smask = gmask[:, None] & (s[None, :] < used)
    m = tl.load(ml, mask=smask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(ml + 1, mask=smask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    if HAS_SINKS:
        m_max = tl.maximum(m_max, sink)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(l * tl.where(m > float("-inf"), tl.exp(m - m_ref[:, None]), 0.0), 1)
    if HAS_SINKS:
        denom += tl.exp(sink - m_ref)
    c = tl.arange(0, 4)
    out = tl.zeros([row.shape[0], HEAD_DIM], tl.float32)
    for s0 in range(0, used, 4):  # four splits' rows at a time keep the registers in bounds
        cmask = gmask[:, None] & (s0 + c[None, :] < used)
        rows = row[:, None] + s0 + c[None, :]
        mc = tl.load(part_ml_ptr + rows * 2, mask=cmask, other=float("-inf"), cache_modifier=".cg")
        wc = tl.where(mc > float("-inf"), tl.exp(mc - m_ref[:, None]), 0.0)
        a = tl.load(
            part_acc_ptr + (rows * HEAD_DIM)[:, :, None] + d[None, None, :],
            mask=cmask[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        out += tl.sum(a * wc[:, :, None], 1)
    return out / denom[:, None]


@triton.jit(do_not_specialize=["bt_stride"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    scale,
    v_scale,
    window,
    soft_cap,
    q_stride_t,
    q_stride_h,
    bt_stride,
    o_stride_t,
    o_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    mblk = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens already in the cache before this step's
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    q_pos = context + rows
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :], mask=rmask[:, None], other=0.0
    )
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q_ptr.dtype.element_ty != tl.float32:
        q, qk_scale = _fp8_query(q, scale)
    else:
        qk_scale = scale
    # keys visible to the last row of this block; nothing when the block lies past the sequence's queries
    kv_end = tl.where(mblk * BLOCK_M < q_len, tl.minimum(seq_len, context + (mblk + 1) * BLOCK_M), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # the block's first query (at context + mblk * BLOCK_M) sees nothing before its window
    kv_start = tl.maximum(context + mblk * BLOCK_M - window + 1, 0) if HAS_WINDOW else 0
    for start in range((kv_start // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        pos = start + n
        pmask = pos < kv_end
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr,
            bt_stride,
            seq,
            kvh,
            pos,
            pmask,
            d,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
        )
        valid = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (q_pos[:, None] - pos[None, :] < window)
        m, l, acc = _attend_tile(q, k, v, valid, m, l, acc, qk_scale, soft_cap, HAS_SOFT_CAP, PRECISION)
    if HAS_SINKS:
        m, l, acc = _fold_sink(m, l, acc, tl.load(sinks_ptr + head).to(tl.float32) + tl.zeros([BLOCK_M], tl.float32))
    out = acc / tl.where(rmask, l, 1.0)[:, None] * v_scale
    tl.store(
        out_ptr + (q_start + rows)[:, None] * o_stride_t + head * o_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None],
    )


def _precision(dtype: torch.dtype) -> str:
    # float32 stays exact (the GPU parity tests compare with transformers in float32); bf16/fp16 use the tensor cores
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(2) == 1 and k_cache.is_contiguous(), "q rows must be contiguous in head_dim; cache contiguous"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    assert num_heads % num_kv_heads == 0
    return num_heads, head_dim, block_size, num_kv_heads


def _sinks_arg(sinks: torch.Tensor | None, num_heads: int, unused: torch.Tensor) -> torch.Tensor:
    """The sinks the kernels read ([num_heads], any float dtype), or a placeholder when there are none."""
    if sinks is None:
        return unused
    assert tuple(sinks.shape) == (num_heads,) and sinks.is_contiguous(), f"sinks must be [{num_heads}] contiguous"
    return sinks


class DecodeRope(NamedTuple):
    """What decode_attention needs to rotate q and the new key and store the new key/value itself:
    positions [num_seqs], the rotary cos/sin tables [max_pos, head_dim] (float32), key/value
    [num_seqs, kv_heads, head_dim] as the projection wrote them (rows may be strided), slot_mapping [num_seqs]."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    rope: DecodeRope | None = None,
    min_split_keys: int = 64,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [num_seqs, heads, head_dim], one new token per sequence; returns the same shape.

    The new token's K/V are already in the cache, or, with rope, are rotated (q too) and stored here.
    num_splits (a power of two) bounds the parts each context (the window's part of it) is divided into,
    computed in parallel; a part spans at least min_split_keys keys (rounded to tiles), so a short context
    takes one program per KV head and no merge. sinks [heads]: each head's sink logit (gpt-oss).
    k_scale/v_scale: an fp8 cache's scales (ignored for any other cache).
    """
    num_heads, head_dim, block_size, num_kv_heads = _check(q, k_cache)
    num_seqs = q.shape[0]
    group = num_heads // num_kv_heads
    fp8 = is_fp8(k_cache)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0
    if num_splits > 1:
        part_acc = torch.empty(num_seqs * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs * num_heads * num_splits, 2, dtype=torch.float32, device=q.device)
        counters = _split_counters(q.device, num_seqs * num_kv_heads)
    else:
        part_acc = part_ml = counters = out  # unused
    if rope is not None:
        assert rope.key.stride(1) == head_dim and rope.value.stride(0) == rope.key.stride(0)
        r = (rope.positions, rope.cos, rope.sin, rope.key, rope.value, rope.slot_mapping)
    else:
        r = (seq_lens,) * 6  # unused
    tile_n, num_warps, num_stages = decode_tiles(head_dim)
    block_n = max(16, min(tile_n, 8 * block_size))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        counters,
        *r,
        _sinks_arg(sinks, num_heads, out),
        scale * k_scale if fp8 else scale,
        k_scale if fp8 else 1.0,
        v_scale if fp8 else 1.0,
        sliding_window or 0,
        logits_soft_cap or 1.0,
        q.stride(0),
        q.stride(1),
        rope.key.stride(0) if rope is not None else 0,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        SPLIT_TILES=max(1, min_split_keys // block_n),
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None,
        HAS_SINKS=sinks is not None,
        ROPE=rope is not None,
        PRECISION=_precision(q.dtype),
        FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# the decode kernel's (largest BLOCK_N, num_warps, num_stages) by head_dim bound (benchmarks/decode_tiles.py)
DECODE_TILES: dict[int, tuple[int, int, int]] = {1 << 30: (64, 4, 3)}


def decode_tiles(head_dim: int) -> tuple[int, int, int]:
    """The decode kernel's largest key tile and launch settings for this head size."""
    return next(t for hd, t in sorted(DECODE_TILES.items()) if head_dim <= hd)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}  # a device's buffers, the newest last (graphs keep the old)


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), that the split programs count their arrivals in;
    the merging program zeroes its counter again, so one buffer serves every launch on the stream."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device))
    return bufs[-1]


# the prefill kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) by head_dim bound; short queries take BLOCK_M 16
# (benchmarks/prefill_tiles.py sweeps them on a GPU)
PREFILL_TILES: dict[int, tuple[int, int, int, int]] = {64: (64, 64, 4, 2), 1 << 30: (64, 32, 4, 3)}


def prefill_tiles(head_dim: int, max_query_len: int) -> tuple[int, int, int, int]:
    """The tile shape and launch settings of the prefill kernel for this head size and longest query."""
    block_m, block_n, warps, stages = next(t for hd, t in sorted(PREFILL_TILES.items()) if head_dim <= hd)
    return (block_m if max_query_len > 32 or batch_invariant.enabled() else 16), block_n, warps, stages


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (packed in q: [tokens, heads, head_dim]) over its context
    (its last sliding_window keys when a window is given; sinks [heads]: each head's sink logit; k_scale/v_scale:
    an fp8 cache's scales, ignored for any other cache)."""
    num_heads, head_dim, block_size, num_kv_heads = _check(q, k_cache)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_m, block_n, num_warps, num_stages = prefill_tiles(head_dim, max_query_len)
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        _sinks_arg(sinks, num_heads, out),
        scale * k_scale if is_fp8(k_cache) else scale,
        v_scale if is_fp8(k_cache) else 1.0,
        sliding_window or 0,
        logits_soft_cap or 1.0,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None,
        HAS_SINKS=sinks is not None,
        PRECISION=_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

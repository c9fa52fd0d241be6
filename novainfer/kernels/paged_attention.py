"""Attention over the paged KV cache in Triton: a decode kernel and a prefill kernel.

Both read keys and values through each sequence's block table, so a cached prefix costs nothing to
re-use, and both keep the softmax online in float32 (flash-attention style).

- decode: one new token per sequence. A program takes one sequence, one KV head and one split of the
  context, and computes all the query heads of that KV head's group at once, so each K/V tile is read
  once per group (GQA). With several splits (split-K, for long contexts and small batches) each writes
  an unnormalised partial result and a second kernel merges them.
- prefill: any number of new tokens per sequence, after any number of cached ones (chunked prefill,
  prefix-cache hits). A program takes BLOCK_M query tokens of one head and walks the visible keys.

Both honour a per-layer sliding window (a query at p sees keys k with p - window < k <= p: the loops
start at the window's first tile, so a long context costs only the window) and logit soft-capping
(cap * tanh(score / cap) before the softmax, Gemma 2). The torch reference is attention/torch_backend.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, bt_stride, seq, kvh, pos, pmask, d,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    blk = tl.load(block_tables_ptr + seq * bt_stride + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
    offs = (slot * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=pmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=pmask[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, valid, m, l, acc, scale, soft_cap, HAS_SOFT_CAP: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step: fold a K/V tile into the running max m, sum l and output acc (float32).

    A row that has seen no visible key yet (a window's edge) keeps m = -inf, l = 0 and acc = 0."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFT_CAP:  # cap * tanh(s / cap), tanh written with exp (saturates to +-1 without overflow)
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr,
                   part_ml_ptr, scale, window, soft_cap, q_stride_t, q_stride_h, bt_stride, o_stride_t, o_stride_h,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
                   PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=gmask[:, None], other=0.0)

    kv_start = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0  # the query sits at seq_len - 1
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for t in range(tile_start, tile_end):
        pos = t * BLOCK_N + n
        pmask = (pos < seq_len) & (pos >= kv_start)
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, bt_stride, seq, kvh, pos, pmask, d,
                             NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        m, l, acc = _attend_tile(q, k, v, pmask[None, :], m, l, acc, scale, soft_cap, HAS_SOFT_CAP, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + seq * o_stride_t + heads[:, None] * o_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        num_heads = NUM_KV_HEADS * GROUP
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD] rows of the partial buffers
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, o_stride_t, o_stride_h,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + row * 2)
    l = tl.load(part_ml_ptr + row * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * o_stride_t + head * o_stride_h + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
                    scale, window, soft_cap, q_stride_t, q_stride_h, bt_stride, o_stride_t, o_stride_h,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, PRECISION: tl.constexpr):
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
    q = tl.load(q_ptr + (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                mask=rmask[:, None], other=0.0)
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
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, bt_stride, seq, kvh, pos, pmask, d,
                             NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        valid = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (q_pos[:, None] - pos[None, :] < window)
        m, l, acc = _attend_tile(q, k, v, valid, m, l, acc, scale, soft_cap, HAS_SOFT_CAP, PRECISION)
    out = acc / tl.where(rmask, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * o_stride_t + head * o_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int = 1,
                     out: torch.Tensor | None = None, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> torch.Tensor:
    """q: [num_seqs, heads, head_dim], one new token per sequence (already in the cache); returns the same shape.

    num_splits (a power of two) divides each context (the window's part of it) into that many parts
    computed in parallel.
    """
    num_heads, head_dim, block_size, num_kv_heads = _check(q, k_cache)
    num_seqs = q.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0
    if num_splits > 1:
        part_acc = torch.empty(num_seqs * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs * num_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, scale, sliding_window or 0,
        logits_soft_cap or 1.0, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=max(16, min(64, 4 * block_size)),
        NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None,
        PRECISION=_precision(q.dtype), num_warps=4)
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits)
    return out


# the prefill kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) by head_dim bound; short queries take BLOCK_M 16
# (benchmarks/prefill_tiles.py sweeps them on a GPU)
PREFILL_TILES: dict[int, tuple[int, int, int, int]] = {64: (64, 64, 4, 2), 1 << 30: (64, 32, 4, 3)}


def prefill_tiles(head_dim: int, max_query_len: int) -> tuple[int, int, int, int]:
    """The tile shape and launch settings of the prefill kernel for this head size and longest query."""
    block_m, block_n, warps, stages = next(t for hd, t in sorted(PREFILL_TILES.items()) if head_dim <= hd)
    return (block_m if max_query_len > 32 else 16), block_n, warps, stages


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                      out: torch.Tensor | None = None, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (packed in q: [tokens, heads, head_dim]) over its context
    (its last sliding_window keys when a window is given)."""
    num_heads, head_dim, block_size, num_kv_heads = _check(q, k_cache)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_m, block_n, num_warps, num_stages = prefill_tiles(head_dim, max_query_len)
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, sliding_window or 0,
        logits_soft_cap or 1.0, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None, PRECISION=_precision(q.dtype), num_warps=num_warps,
        num_stages=num_stages)
    return out

"""The float32 ops of a CPU decode step in C (csrc/decode_ops_cpu.c, decode attention in
csrc/decode_attention_cpu.c): each replaces 5-10 small torch ops, whose per-op cost dominated a 30-layer decode
step of the default model once the weights were quantized; and the prefill attention over the bf16 cache
(csrc/prefill_attention_cpu.c).

Used by the layers of a model built for the quantized CPU path (QuantizationConfig.fused_cpu_ops); the
float32 exact path (dtype="float32") keeps the torch ops. Each wrapper checks what the C code assumes.
"""

from __future__ import annotations

import ctypes

import torch

from novainfer.kernels.cpu.library import library, num_threads


def usable(x: torch.Tensor) -> bool:
    """True for what the C ops take: a float32 CPU tensor whose last dim is contiguous."""
    return x.dtype is torch.float32 and x.stride(-1) == 1 and not x.is_cuda


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); without a residual, x itself is the new residual."""
    x = x.contiguous()
    m, h = x.numel() // x.shape[-1], x.shape[-1]
    out = torch.empty_like(x)
    if residual is None:
        library().add_rms_norm(x.data_ptr(), None, None, weight.data_ptr(), eps, out.data_ptr(), m, h, num_threads())
        return out, x
    residual = residual.contiguous()
    new_res = torch.empty_like(x)
    library().add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        new_res.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        m,
        h,
        num_threads(),
    )
    return out, new_res


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    library().silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], d, num_threads())
    return out


def rms_norm_add(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor) -> torch.Tensor:
    """residual + add_rms_norm(x) over the last dim (Gemma's post-norm then residual add, one pass): the norm's
    bits are add_rms_norm's, the sum torch's."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    library().rms_norm_add(
        x2.data_ptr(),
        x2.stride(0),
        weight.data_ptr(),
        eps,
        residual.data_ptr(),
        out.data_ptr(),
        x2.shape[0],
        h,
        num_threads(),
    )
    return out


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for [M, D] rows (each may be a strided view, e.g. the halves of a fused gate/up)."""
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    m, d = gate.shape
    out = torch.empty(m, d, dtype=torch.float32)
    library().gelu_tanh_mul(
        gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), m, d, num_threads()
    )
    return out


def rotary_neox_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates q [T, heads, D] and k [T, kv_heads, D] in place (views of one fused qkv row are fine)."""
    t, nq, d = q.shape
    if q.stride(1) != d or k.stride(1) != d:
        raise ValueError("rotary_neox_: each head's values must be contiguous")
    pos = positions.to(torch.int64).contiguous()
    rc = library().rotary_neox(
        q.data_ptr(),
        q.stride(0),
        nq,
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        pos.data_ptr(),
        t,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        d,
        num_threads(),
    )
    if rc:
        raise ValueError(f"a position is outside the rotary table of {cos.shape[0]} positions")


def store_kv_bf16(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [T, kv_heads, D] (rows may be strided) -> bf16 caches [blocks, block_size, kv_heads, D]; a slot
    outside the cache raises ValueError before anything is written."""
    slots = slot_mapping.to(torch.int64).contiguous()
    width = key.shape[1] * key.shape[2]
    if v_cache.shape != k_cache.shape or k_cache.shape[2] * k_cache.shape[3] != width:
        raise ValueError(
            f"store_kv_bf16: K/V rows of {width} values do not fit caches of shapes "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    where = KVWhere()
    rc = library().store_kv_bf16(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        width,
        num_threads(),
        k_cache.shape[0] * k_cache.shape[1],
        where,
    )
    if rc:
        raise kv_index_error(rc, where, k_cache.shape[0], k_cache.shape[1], slots=slots)


def decode_attention_bf16(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, query [S, heads, D], over the bf16 paged cache -> [S, heads, D] float32 (sinks
    [heads]: each head's sink logit); a block id outside the cache or a length past the block table raises
    ValueError before anything is read."""
    s, nh, d = query.shape
    block_size, nkv = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if tables.dim() != 2 or tables.shape[0] < s or lens.shape != (s,):
        raise ValueError(
            f"decode attention of {s} sequences: block tables {tuple(tables.shape)}, seq_lens {tuple(lens.shape)}"
        )
    num_blocks = min(k_cache.shape[0], v_cache.shape[0])
    sinks = _sinks_f32(sinks, nh)
    out = torch.empty(s, nh, d, dtype=torch.float32)
    where = KVWhere()
    rc = library().decode_attention_bf16(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        s,
        nh,
        nkv,
        d,
        block_size,
        scale,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        num_threads(),
        num_blocks,
        where,
    )
    if rc == KV_NO_MEMORY:
        raise MemoryError("decode attention: no memory for the scores")
    if rc:
        raise kv_index_error(rc, where, num_blocks, block_size, tables=tables, seq_lens=lens)
    return out


def _sinks_f32(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Sinks [num_heads] as the C attention reads them (contiguous float32); None stays None."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks: one logit per head ({num_heads}) expected, got shape {tuple(sinks.shape)}")
    return sinks.detach().to(torch.float32).contiguous()


KVWhere = ctypes.c_int * 2  # the offending token, or sequence and block-table entry, of a failed KV op
KV_NO_MEMORY, KV_BAD_SLOT, KV_BAD_SEQ_LEN, KV_BAD_BLOCK, KV_BAD_QUERIES = -1, 1, 2, 3, 4  # csrc/cpu_kernels.h


def kv_index_error(
    rc: int,
    where: ctypes.Array,
    num_blocks: int,
    block_size: int,
    slots: torch.Tensor | None = None,
    tables: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> Exception:
    """The exception for a KV op's bad-index code rc (also the C decoder stack's, decoder_stack.py), naming the
    index it found (where) in the step's slots [T], block tables [S, width], seq_lens [S] or query starts [S + 1]."""
    if rc == KV_BAD_SLOT:
        t = where[0]
        return ValueError(
            f"KV slot {int(slots[t])} (token {t}) is outside the cache of {num_blocks * block_size} slots"
        )
    if rc == KV_BAD_SEQ_LEN:
        s, width = where[0], tables.shape[1]
        return ValueError(
            f"sequence {s}'s length {int(seq_lens[s])} is outside [1, {width * block_size}] "
            f"(its block table holds {width} blocks of {block_size} tokens)"
        )
    if rc == KV_BAD_BLOCK:
        s, b = where[0], where[1]
        return ValueError(
            f"block id {int(tables[s, b])} (sequence {s}, block table entry {b}) is outside the "
            f"cache of {num_blocks} blocks"
        )
    if rc == KV_BAD_QUERIES:
        s = where[0]
        return ValueError(
            f"sequence {s}'s new tokens {int(starts[s])}..{int(starts[s + 1])} are out of order, past "
            f"the step's tokens or more than its length {int(seq_lens[s])}"
        )
    return RuntimeError(f"KV op: error {rc}")


def prefill_attention_bf16(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's new tokens, query [T, heads, D] (the i-th of q at position seq_len - q + i), causal over
    the bf16 paged cache (which already holds them) -> [T, heads, D] float32 (sinks [heads]: each head's sink
    logit); a bad block id, length or query range raises ValueError before anything is read."""
    t, nh, d = query.shape
    block_size, nkv = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    s = lens.shape[0]
    if lens.dim() != 1 or tables.dim() != 2 or tables.shape[0] < s or starts.shape != (s + 1,):
        raise ValueError(
            f"prefill attention: block tables {tuple(tables.shape)}, query starts "
            f"{tuple(starts.shape)} and seq_lens {tuple(lens.shape)} do not describe one set of sequences"
        )
    num_blocks = min(k_cache.shape[0], v_cache.shape[0])
    sinks = _sinks_f32(sinks, nh)
    out = torch.empty(t, nh, d, dtype=torch.float32)
    where = KVWhere()
    rc = library().prefill_attention_bf16(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        starts.data_ptr(),
        lens.data_ptr(),
        s,
        nh,
        nkv,
        d,
        block_size,
        scale,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        num_threads(),
        t,
        num_blocks,
        where,
    )
    if rc == KV_NO_MEMORY:
        raise MemoryError("prefill attention: no memory for the widened K/V or the scores")
    if rc:
        raise kv_index_error(rc, where, num_blocks, block_size, tables=tables, seq_lens=lens, starts=starts)
    return out

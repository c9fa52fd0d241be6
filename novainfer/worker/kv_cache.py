"""The paged KV cache of one model: its bytes per block, how many blocks fit (as configured, the CPU's token budget,
or on CUDA the memory left after the weights and a profiling step's peak), and its one tensor, whose views the
model's Attention layers read. The target's runner and the draft model's runner both build theirs here.

A layer that reads another's cache (kv_source, Gemma 4's KV sharing) gets no cache of its own. Where the
layers' K/V shapes differ (Gemma 4: wider heads on its full-attention layers), the one tensor is flat and each
layer's views are consecutive slices of it. A model with sliding-window layers takes the grouped layout of
worker/kv_layout.py instead: one block pool, a block table per KV group, sliding groups keeping only their window."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from novainfer.attention.metadata import attention_metadata
from novainfer.config import CacheConfig
from novainfer.layers.attention import Attention
from novainfer.layers.sampler import Sampler
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow
from novainfer.sampling_params import SamplingParams
from novainfer.worker.kernel_warmup import packed_prefill_metadata
from novainfer.worker.kv_layout import KVLayout, allocate_grouped, plan_kv_layout


def _cache_owners(layers: list[Attention]) -> list[Attention]:
    """The layers that store K/V (the others read an owner's)."""
    return [layer for layer in layers if layer.kv_source is None]


def kv_bytes_per_block(layers: list[Attention], block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one block of block_size tokens takes over all of layers (K and V)."""
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * kv_dtype.itemsize for a in _cache_owners(layers))


def kv_layout_of(layers: list[Attention], block_size: int) -> KVLayout | None:
    """The grouped layout of the layers' caches (worker/kv_layout.py), or None for the whole-context one."""
    return plan_kv_layout([(a.sliding_window, a.num_kv_heads * a.head_dim) for a in _cache_owners(layers)], block_size)


def allocate_kv_cache(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    backend: ModuleType,
    layout: KVLayout | None = None,
) -> torch.Tensor:
    """One tensor [2, layers, blocks, block_size, kv_heads, head_dim] (flat where the layers' shapes differ), or
    the grouped layout's; each layer gets views and the backend."""
    owners = _cache_owners(layers)
    for layer in layers:
        layer.backend = backend
    if layout is not None:
        return allocate_grouped(owners, layout, num_blocks, block_size, kv_dtype, device)
    shapes = {(a.num_kv_heads, a.head_dim) for a in owners}
    a = owners[0]
    shape = (2, len(owners), num_blocks, block_size, a.num_kv_heads, a.head_dim)
    per_layer = [num_blocks * block_size * o.num_kv_heads * o.head_dim for o in owners]
    numel = int(np.prod(shape)) if len(shapes) == 1 else 2 * sum(per_layer)
    # A large CPU cache is taken fresh from mmap, whose pages are zero and become resident only when
    # written, so RSS grows with the tokens cached, not the capacity (the same zeros torch.zeros writes).
    lazy = device.type == "cpu" and numel * kv_dtype.itemsize >= 64 << 20
    kv_cache = (torch.empty if lazy else torch.zeros)(
        shape if len(shapes) == 1 else (numel,), dtype=kv_dtype, device=device
    )
    offset = 0
    for i, layer in enumerate(owners):
        if len(shapes) == 1:
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
            continue
        view = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        k, v = kv_cache[offset : offset + 2 * per_layer[i]].chunk(2)
        layer.k_cache, layer.v_cache = k.view(view), v.view(view)
        offset += 2 * per_layer[i]
    return kv_cache


def release_kv_cache(layers: list[Attention]) -> None:
    """Drop the layers' views, so the cache's memory is freed once its tensor is."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.tensor([])


def num_blocks_that_fit(
    cc: CacheConfig,
    device: torch.device,
    block_size: int,
    bytes_per_block: int,
    profile_run: Callable[[], None],
    cpu_state_bytes: int = 0,
    whole_context_bytes_per_block: int | None = None,
) -> int:
    """Blocks that fit: configured, else free GPU memory after profile_run, else the CPU budget (less what a
    hybrid model's state slots take of it). The CPU budget counts tokens of the whole-context layout
    (whole_context_bytes_per_block a block), so a grouped layout gets as many bytes, in its own blocks."""
    if cc.num_gpu_blocks is not None:
        return cc.num_gpu_blocks
    if device.type != "cuda":
        whole = whole_context_bytes_per_block or bytes_per_block
        num_blocks = cc.cpu_kv_cache_tokens // block_size - -(-cpu_state_bytes // whole)
        return max(1, num_blocks * whole // bytes_per_block)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_run()
    torch.cuda.empty_cache()  # give the profile's scratch back, so it is counted once (as the peak)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, the CUDA context, anything else on the device
    peak_activations = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = total * cc.gpu_memory_utilization - used - peak_activations
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1:
        raise RuntimeError(
            f"the model does not leave room for a KV cache: {used / 2**30:.2f} GiB used of "
            f"{total / 2**30:.2f} GiB with gpu_memory_utilization={cc.gpu_memory_utilization}; "
            "raise gpu_memory_utilization or use a smaller model"
        )
    return num_blocks


def profile_lens(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The prompt lengths of the largest step: the whole token budget in as few sequences as max_model_len allows
    (a budget past max_model_len is only reached by several prompts at once)."""
    full, rest = divmod(min(max_num_batched_tokens, max_model_len * max_num_seqs), max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def profile_blocks(lens: list[int], block_size: int) -> int:
    """Blocks of the scratch cache that profile_step's sequences (of lens tokens) fill."""
    return sum((n + block_size - 1) // block_size for n in lens)


@torch.inference_mode()
def profile_step(
    model: nn.Module, sampler: Sampler, drafter: Any, lens: list[int], rows: int, block_size: int, device: torch.device
) -> None:
    """The largest step's forward (fresh prompts of lens tokens, packed, over a scratch cache of profile_blocks
    blocks the caller bound) and a sampling pass over rows rows with every parameter on; the draft model's forward
    (drafter, or None) apart."""
    meta = packed_prefill_metadata(lens, block_size, device)
    ids = torch.zeros(sum(lens), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    if drafter is not None:  # its forwards run apart from the target's, so its peak is measured alone
        drafter.profile_run(ids, positions, meta, rows)
    with attention_metadata(meta):
        hidden = model(ids, positions)
    logits = model.compute_logits(hidden[-rows:]).float()
    worst = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.1, logprobs=20
    )
    sampler(logits, SamplingMetadata.build([SamplingRow(worst, [0], [0])] * rows, logits.shape[-1], device))

"""How many KV cache blocks fit: as configured, the CPU's token budget, or on CUDA the memory left after the
weights and the peak of a profiling step (one forward over a full token budget and a worst-case sampling pass)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from novainfer.attention.metadata import attention_metadata
from novainfer.config import CacheConfig
from novainfer.layers.sampler import Sampler
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow
from novainfer.sampling_params import SamplingParams
from novainfer.worker.kernel_warmup import one_sequence_metadata


def num_blocks_that_fit(cc: CacheConfig, device: torch.device, block_size: int, bytes_per_block: int,
                        profile_run: Callable[[], None]) -> int:
    """Blocks that fit: configured, else free GPU memory after profile_run, else the CPU budget."""
    if cc.num_gpu_blocks is not None:
        return cc.num_gpu_blocks
    if device.type != "cuda":
        return max(1, cc.cpu_kv_cache_tokens // block_size)
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
            "raise gpu_memory_utilization or use a smaller model")
    return num_blocks


@torch.inference_mode()
def profile_step(model: nn.Module, sampler: Sampler, drafter: Any, num_tokens: int, rows: int, block_size: int,
                 device: torch.device) -> None:
    """The largest step's forward (one sequence of num_tokens over a scratch cache the caller bound) and a
    sampling pass over rows rows with every parameter on; the draft model's forward (drafter, or None) apart."""
    meta = one_sequence_metadata(num_tokens, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    if drafter is not None:  # its forwards run apart from the target's, so its peak is measured alone
        drafter.profile_run(ids, meta, rows)
    with attention_metadata(meta):
        hidden = model(ids, torch.arange(num_tokens, device=device))
    logits = model.compute_logits(hidden[-rows:]).float()
    worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.1, repetition_penalty=1.1,
                           presence_penalty=0.1, logprobs=20)
    sampler(logits, SamplingMetadata.build([SamplingRow(worst, [0], [0])] * rows, logits.shape[-1], device))

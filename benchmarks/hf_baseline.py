"""The baseline: Hugging Face transformers `generate` on the same prompts, padded batches (left padding)."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM


def hf_generate(
    path: str, prompts: list[list[int]], out_lens: list[int], batch_size: int, temperature: float
) -> tuple[float, int]:
    """Seconds and useful output tokens: each batch generates its longest output; a prompt counts only its own."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = 0
    run(model, prompts[:1], [4], temperature, pad, device)  # warm-up
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch_size):
        run(model, prompts[i : i + batch_size], out_lens[i : i + batch_size], temperature, pad, device)
        useful += sum(out_lens[i : i + batch_size])
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return elapsed, useful


@torch.inference_mode()
def run(model, prompts: list[list[int]], out_lens: list[int], temperature: float, pad: int, device: str) -> None:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    n = max(out_lens)
    sample = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=pad,
        eos_token_id=None,
        **sample,
    )
    assert out.shape[1] == width + n

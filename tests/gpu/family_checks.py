"""The model families' GPU checks, run by tests/gpu/gpu_check.py: the MoE kernel and the sliding-window / soft-cap
attention kernels on real shapes in bf16 against their torch references, and the new families' greedy
tokens against transformers on the GPU. Each function takes the device, dtype and shapes, so
tests/test_gpu_check_cpu.py runs the same code on the CPU (Triton interpreted, tiny shapes, float32).
"""

from __future__ import annotations

import gc
import os

import torch

from novainfer.attention import torch_backend
from novainfer.layers.activation import SiluAndMul
from novainfer.layers.fused_moe import fused_experts_torch, select_experts
from tests.gpu.checks import check, paged_case

# (name, experts, top_k, hidden, moe intermediate): Qwen3-30B-A3B, Qwen2-57B-A14B, Mixtral-8x7B
MOE_SHAPES = [
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("qwen2-57b-a14b", 64, 8, 3584, 2560),
    ("mixtral-8x7b", 8, 2, 4096, 14336),
]
MOE_TOKENS = [1, 64, 2048]
# (name, heads, kv heads, head_dim, window, soft cap): Gemma-2-9B sliding layers, Mistral-7B-v0.1
WINDOW_SHAPES = [("gemma-2-9b", 16, 8, 256, 4096, 50.0), ("mistral-7b", 32, 8, 128, 4096, None)]
WINDOW_CONTEXTS = [0, 15, 100, 4095, 4097, 6000]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def moe_kernel_checks(
    dev: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    shapes=MOE_SHAPES,
    token_counts=MOE_TOKENS,
    tol: float = 1e-2,
) -> None:
    from novainfer.kernels.fused_moe import fused_experts

    for name, experts, top_k, hidden, inter in shapes:
        g = torch.Generator(device=dev).manual_seed(experts)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=g) * hidden**-0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=dev, generator=g) * inter**-0.5).to(dtype)
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, device=dev, generator=g).to(dtype)
            skew = torch.linspace(2.0, -2.0, experts, device=dev)  # uneven routing: low experts are popular
            weights, ids = select_experts(torch.randn(tokens, experts, device=dev, generator=g) + skew, top_k, True)
            out = fused_experts(x, w13, w2, weights, ids, SiluAndMul())
            ref = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids, SiluAndMul())
            e = rel(out, ref)
            check(f"fused MoE kernel {name} tokens={tokens}", f"rel err {e:.2e} ({dtype})", e <= tol)
        del w13, w2


def window_kernel_checks(
    dev: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    shapes=WINDOW_SHAPES,
    contexts=WINDOW_CONTEXTS,
    block_size: int = 16,
    tol: float = 1e-2,
) -> None:
    from novainfer.kernels.paged_attention import decode_attention, prefill_attention

    for name, heads, kv_heads, hd, window, cap in shapes:
        g = torch.Generator(device=dev).manual_seed(heads + hd)
        for q_lens in ([1] * len(contexts), [min(300, c + 1) for c in contexts]):
            q, kc, vc, bt, meta = paged_case(dev, g, contexts, q_lens, block_size, heads, kv_heads, hd, dtype, 4)
            scale = hd**-0.5
            ref = torch_backend.paged_attention(q.float(), kc.float(), vc.float(), meta, scale, window, cap)
            what = f"window={window} cap={cap}"
            if max(q_lens) == 1:
                for splits in (1, 8):
                    out = decode_attention(
                        q, kc, vc, bt, meta.seq_lens, scale, splits, sliding_window=window, logits_soft_cap=cap
                    )
                    e = rel(out, ref)
                    check(f"decode kernel {name} {what} splits={splits}", f"rel err {e:.2e}", e <= tol)
            else:
                out = prefill_attention(
                    q,
                    kc,
                    vc,
                    bt,
                    meta.query_start_loc,
                    meta.seq_lens,
                    max(q_lens),
                    scale,
                    sliding_window=window,
                    logits_soft_cap=cap,
                )
                e = rel(out, ref)
                check(f"prefill kernel {name} {what} cached prefix", f"rel err {e:.2e}", e <= tol)


def families_vs_hf(tmp: str, archs=None, n: int = 32) -> None:
    """Engine greedy tokens == transformers' in float32 on the GPU (CUDA graphs on), a prompt past the window."""
    from transformers import AutoModelForCausalLM

    from novainfer import LLM, SamplingParams
    from tests.tiny_models import FAMILIES, hf_greedy_with, make_tiny_model

    prompts = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. The capital of France is"]
    for arch in archs or sorted(FAMILIES):
        path = make_tiny_model(os.path.join(tmp, arch), arch, seed=7)
        llm = LLM(path, dtype="float32", gpu_memory_utilization=0.3)
        tok = llm.get_tokenizer()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        # eager attention: transformers' sdpa path leaves out Gemma 2's logit soft-capping (seen with 5.17)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").cuda().eval()
        ok = all(o.outputs[0].token_ids == hf_greedy_with(hf, tok.encode(p), n) for p, o in zip(prompts, outs))
        check(f"engine greedy == HF, {arch}, fp32, GPU", f"{n} tokens x {len(prompts)} prompts", ok)
        del llm, hf
        gc.collect()
        torch.cuda.empty_cache()

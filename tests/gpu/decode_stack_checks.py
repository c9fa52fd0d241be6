"""Checks of the batch-1 decode stack (novainfer/worker/gpu_decode_stack.py) on a GPU, for gpu_check.py's
"decode_stack" group: its GEMVs and its fused decode kernel in bf16 on Qwen2.5 shapes against the
layer-by-layer kernels, and one-sequence greedy decoding with the stack (CUDA graphs on) against
transformers in float32."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from tests.gpu.checks import check, paged_case


def gemv_checks() -> None:
    from novainfer.kernels.fused_ops import rms_norm, silu_and_mul
    from novainfer.kernels.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    for hidden, q_out, inter in [(896, 1152, 4864), (3584, 4608, 18944)]:
        errs = []
        for n, k, norm, act in [
            (q_out, hidden, True, False),
            (hidden, hidden, False, False),
            (2 * inter, hidden, True, True),
            (hidden, inter, False, False),
        ]:
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
            r = torch.randn(1, k, device="cuda", generator=g).bfloat16()
            nw = (torch.rand(k, device="cuda", generator=g) + 0.5).bfloat16()
            if norm:
                (y, res), (ref_x, ref_res) = (
                    gemv(x, w, norm_weight=nw, eps=1e-6, residual=r, silu_and_mul=act),
                    rms_norm(x, nw, 1e-6, r),
                )
                errs.append(0.0 if torch.equal(res, ref_res) else 1.0)
            else:
                y, ref_x = gemv(x, w), x
            ref = F.linear(ref_x.float(), w.float())
            ref = silu_and_mul(ref.bfloat16()).float() if act else ref
            errs.append(((y.float() - ref).norm() / ref.norm()).item())
        check(
            f"GEMV + norm prologue / SiLU epilogue == norm + linear + silu, hidden {hidden}, bf16",
            f"max rel err {max(errs):.1e}",
            max(errs) <= 1e-2,
        )


def fused_attention_checks() -> None:
    from novainfer.kernels.fused_ops import rotary_embedding
    from novainfer.kernels.kv_store import store_kv
    from novainfer.kernels.paged_attention import DecodeRope, decode_attention

    for heads, kv_heads, hd in [(14, 2, 64), (28, 4, 128)]:
        g = torch.Generator(device="cuda").manual_seed(heads)
        ctx = [0, 15, 16, 500, 3000]
        _, kc, vc, bt, meta = paged_case("cuda", g, ctx, [1] * len(ctx), 16, heads, kv_heads, hd, torch.bfloat16)
        qkv = torch.randn(len(ctx), (heads + 2 * kv_heads) * hd, device="cuda", generator=g).bfloat16()
        q = qkv[:, : heads * hd].view(-1, heads, hd)
        k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(-1, kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd :].view(-1, kv_heads, hd)
        pos = meta.seq_lens.long() - 1
        slots = torch.stack([bt[i, c // 16].long() * 16 + c % 16 for i, c in enumerate(ctx)])
        slots[2] = -1  # a padding row writes nothing
        ang = torch.arange(4096, device="cuda").float()[:, None] / (1e6 ** (torch.arange(0, hd, 2, device="cuda") / hd))
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        kc2, vc2 = kc.clone(), vc.clone()
        rq, rk = rotary_embedding(pos, q, k, cos, sin)
        store_kv(rk, v, kc, vc, slots)
        # torch's bf16 rotary (each product rounded, as transformers computes it) for the keys that get stored
        c, s_ = cos[pos].bfloat16()[:, None], sin[pos].bfloat16()[:, None]
        torch_k = k * c + torch.cat([-k[..., hd // 2 :], k[..., : hd // 2]], -1) * s_
        rows = [0, 1, 3, 4]  # row 2 is padding
        slot_rows = slots[rows]
        off_torch_rotary = (rk[rows] != torch_k[rows]).sum().item()
        worst, stored_ok, off_torch, key_err = 0.0, True, 0, 0.0
        for splits in (1, 8, 32):
            kc3, vc3 = kc2.clone(), vc2.clone()
            ref = decode_attention(rq, kc, vc, bt, meta.seq_lens, hd**-0.5, splits)
            out = decode_attention(
                q, kc3, vc3, bt, meta.seq_lens, hd**-0.5, splits, rope=DecodeRope(pos, cos, sin, k, v, slots)
            )
            flat_k, flat_ref = kc3.view(-1, kv_heads, hd), kc.view(-1, kv_heads, hd)
            others = torch.ones(flat_k.shape[0], dtype=torch.bool, device="cuda")
            others[slot_rows] = False
            stored_ok &= torch.equal(vc3, vc) and torch.equal(flat_k[others], flat_ref[others])
            stored = flat_k[slot_rows]
            off_torch = max(off_torch, (stored != torch_k[rows]).sum().item())
            ref_k = torch_k[rows].float()
            key_err = max(key_err, ((stored.float() - ref_k).norm() / ref_k.norm()).item())
            worst = max(worst, ((out[rows].float() - ref[rows].float()).norm() / ref[rows].float().norm()).item())
        check(
            f"fused rotary + KV store + decode == the three kernels, heads {heads}/{kv_heads}x{hd}, bf16",
            f"contexts {ctx}, splits 1/8/32: max rel err {worst:.1e}; values and untouched slots equal {stored_ok}; "
            f"new keys vs torch's bf16 rotary: rel err {key_err:.1e}, elements off (1 ulp) fused {off_torch}, "
            f"rotary kernel {off_torch_rotary} of {torch_k[rows].numel()}",
            worst <= 1e-2 and stored_ok and key_err <= 1e-2,
        )


@contextmanager
def counting_stack_calls() -> Iterator[list[bool]]:
    """While open, GPUDecodeStack.forward records in the yielded list whether each call ran the stack."""
    from novainfer.worker.gpu_decode_stack import GPUDecodeStack

    calls: list[bool] = []
    original = GPUDecodeStack.forward

    def counted(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    GPUDecodeStack.forward = counted
    try:
        yield calls
    finally:
        GPUDecodeStack.forward = original


def stack_vs_hf(tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from novainfer import LLM, SamplingParams
    from tests.tiny_models import hf_greedy_with, make_tiny_model

    with counting_stack_calls() as calls:
        for arch in ("qwen2", "llama"):
            calls.clear()
            path = make_tiny_model(os.path.join(tmp, f"stack_{arch}"), arch, seed=13)
            llm = LLM(path, dtype="float32", gpu_memory_utilization=0.3)
            tok = llm.get_tokenizer()
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
            ok = True
            for p in ["Hello, my name is", "def add(a, b):"]:  # one sequence at a time: batch-1 decode steps
                out = llm.generate([p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
                ok &= out[0].outputs[0].token_ids == hf_greedy_with(hf, tok.encode(p), 32)
            runner = llm.llm_engine.executor.workers[0].model_runner
            used = runner.decode_strategy is not None and any(calls)
            check(
                f"decode stack: batch-1 greedy == HF, {arch}, fp32, GPU",
                f"32 tokens x 2 prompts, graphs={runner.graphs is not None}, stack used={used}",
                ok and used,
            )
            del llm, hf, runner
            gc.collect()
            torch.cuda.empty_cache()


def decode_stack_checks(tmp: str) -> None:
    gemv_checks()
    fused_attention_checks()
    stack_vs_hf(tmp)

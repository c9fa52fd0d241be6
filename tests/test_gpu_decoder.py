"""The batch-1 fused decode stack (worker/gpu_decode_stack.py) on the CPU, its Triton kernels interpreted
(TRITON_INTERPRET=1, set in conftest.py): the GEMVs with their fused ops against torch, and the whole
engine's greedy tokens with the stack against transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("novainfer.kernels.paged_attention")
from novainfer.kernels import fused_ops  # noqa: E402
from novainfer.kernels.gemv import gemv  # noqa: E402
from novainfer.attention import triton_backend  # noqa: E402
from novainfer.worker.decode_strategy import select_decode_strategy  # noqa: E402
from novainfer.worker.gpu_decode_stack import GPUDecodeStack, supports  # noqa: E402
from tests.gpu.decode_stack_checks import counting_stack_calls  # noqa: E402


@pytest.mark.parametrize("n,k", [(37, 50), (130, 300)])
def test_gemv_prologue_and_epilogue_match_torch(n, k):
    """Plain (+ bias), the residual add + RMSNorm prologue, and the SiLU-and-mul epilogue over stacked gate/up rows
    (+ bias); odd sizes, several K tiles. float16: the interpreter has no bfloat16 arithmetic (bf16 is checked on
    the GPU by gpu_check.py)."""
    g = torch.Generator().manual_seed(n)
    dt = torch.float16
    w, b = torch.randn(n, k, generator=g).to(dt), torch.randn(n, generator=g).to(dt)
    x, r, nw = (torch.randn(1, k, generator=g).to(dt) for _ in range(3))
    gate_up, gate_up_b = torch.randn(2 * n, k, generator=g).to(dt), torch.randn(2 * n, generator=g).to(dt)

    def close(y, ref):
        assert (y.float() - ref.float()).abs().max() <= 2e-3 * ref.float().abs().max() + 1e-3

    close(gemv(x, w, b, tiles=(8, 64, 4, 1)), F.linear(x.float(), w.float(), b.float()))
    y, new_res = gemv(x, w, norm_weight=nw[0], eps=1e-6, residual=r, tiles=(4, 32, 4, 1))
    ref_x, ref_res = fused_ops.rms_norm(x, nw[0], 1e-6, r)
    assert torch.equal(new_res, ref_res)
    close(y, F.linear(ref_x.float(), w.float()))
    close(gemv(x, w, norm_weight=nw[0], eps=1e-6), F.linear(fused_ops.rms_norm(x, nw[0], 1e-6).float(), w.float()))
    ref = fused_ops.silu_and_mul(F.linear(x.float(), gate_up.float(), gate_up_b.float()).to(dt))
    close(gemv(x, gate_up, gate_up_b, silu_and_mul=True, tiles=(16, 128, 2, 1)), ref)
    if k % 10 == 0:  # the output gate's prologue: x * sigmoid(gate), gate's heads of 10 strided (Qwen3.5's qkv row)
        row = torch.randn(1, k // 10, 30, generator=g).to(dt)
        gate = row[..., 10:20]
        ref_x = x * torch.sigmoid(gate.reshape(1, k))
        close(gemv(x, w, b, gate=gate, tiles=(8, 64, 4, 1)), F.linear(ref_x.float(), w.float(), b.float()))


def test_block_fp8_gemv_with_prologue_and_epilogue_matches_the_dequantized_product():
    """Block-scaled float8 weights (pre-quantized FP8): each block's scale applied to x's inputs, the norm prologue
    and the SiLU-and-mul epilogue over gate/up rows whose scale rows differ, K not a multiple of the tile or the
    block, equal the same ops over the dequantized weight."""
    from novainfer.layers.quantization.fp8_block import expand_blocks

    g = torch.Generator().manual_seed(3)
    n, k, block = 32, 100, (16, 32)
    w = (torch.randn(2 * n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2 * n // 16, -(-k // 32), generator=g) + 0.01
    deq = w.float() * expand_blocks(scale, block, (2 * n, k))
    x, r, nw = (torch.randn(1, k, generator=g) for _ in range(3))
    ref = F.linear(x, deq[:n])
    got = gemv(x, w[:n].contiguous(), weight_scale=scale[: n // 16].contiguous(), block=block, tiles=(8, 64, 4, 1))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    normed, new_res = fused_ops.rms_norm(x, nw[0], 1e-6, r)
    gate, up = F.linear(normed, deq).split(n, dim=-1)
    y, res = gemv(x, w, weight_scale=scale, block=block, norm_weight=nw[0], eps=1e-6, residual=r,
                  silu_and_mul=True, tiles=(16, 32, 4, 1))  # fmt: skip
    assert torch.equal(res, new_res)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-4, atol=1e-3)  # rstd on the sums: another rounding


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])
def test_engine_with_stack_matches_transformers(fixture, request):
    """One sequence at a time (so every decode step takes the stack), prompts that cross KV blocks, greedy
    tokens equal to transformers'; the stack ran every decode step."""
    from novainfer import LLM, SamplingParams
    from tests.tiny_models import hf_greedy

    path = request.getfixturevalue(fixture)
    llm = LLM(path, dtype="float32", attention_backend="triton", block_size=4, enforce_eager=True)
    runner = llm.llm_engine.executor.workers[0].model_runner
    # the runner's stack runs in CUDA graphs only; here the eager steps take it too
    runner.decode_strategy = select_decode_strategy(runner.model, triton_backend, graphs_only=False)
    assert supports(runner.model.model) and isinstance(runner.decode_strategy, GPUDecodeStack)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with counting_stack_calls() as calls:
        for prompt in ["Hello", "The quick brown fox jumps over the lazy dog"]:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == hf_greedy(path, tok.encode(prompt), 8), prompt
    assert calls.count(True) == 2 * 7 and calls.count(False) == 2  # each prompt: 7 decode steps, one prefill


def test_block_fp8_model_takes_the_stack_and_matches_the_layer_path(tmp_path):
    """A pre-quantized block-FP8 checkpoint: the stack reads its float8 weights with their block scales (x not
    quantized, as the one-row layer path does), so its greedy tokens equal the layer-by-layer path's."""
    from novainfer import LLM, SamplingParams
    from tests.test_quant_formats import FORMATS, write_pair
    from tests.tiny_models import make_tiny_model

    base = make_tiny_model(str(tmp_path / "qwen2"), "qwen2", seed=7, num_heads=4, num_kv_heads=4, head_dim=32)
    quantize, qconfig, _ = FORMATS["fp8-block"]
    qdir, ddir = write_pair(base, str(tmp_path / "fp8"), quantize, qconfig)
    # no prefix cache: the second run's prompt is a prefill as the first's (a prefill quantizes x per group)
    llm = LLM(
        qdir, dtype="float32", attention_backend="triton", block_size=4, enforce_eager=True, enable_prefix_caching=False
    )
    runner = llm.llm_engine.executor.workers[0].model_runner
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = "The quick brown fox jumps over the lazy dog"
    runner.decode_strategy = None
    layered = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    runner.decode_strategy = select_decode_strategy(runner.model, triton_backend, graphs_only=False)
    assert supports(runner.model.model) and isinstance(runner.decode_strategy, GPUDecodeStack)
    with counting_stack_calls() as calls:
        stacked = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert calls.count(True) == 7 and stacked.token_ids == layered.token_ids
    for t, a, b in zip(stacked.token_ids, stacked.logprobs, layered.logprobs):
        assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_stack_refuses_layers_it_does_not_fuse(tiny_qwen3):
    """Qwen3 normalises q and k per head: not a piece the stack fuses, so its model keeps the layer path."""
    from novainfer import LLM

    llm = LLM(tiny_qwen3, dtype="float32", attention_backend="triton", block_size=4, enforce_eager=True)
    runner = llm.llm_engine.executor.workers[0].model_runner
    assert not supports(runner.model.model) and runner.decode_strategy is None


def test_stack_waits_for_a_graph_by_default(tiny_qwen2):
    """As the runner enables it (graphs_only): eager one-token steps keep the layer-by-layer kernels, since a
    Triton launch from Python costs more host time than the kernels it replaces; only a graph capture takes it."""
    from novainfer import LLM, SamplingParams

    llm = LLM(tiny_qwen2, dtype="float32", attention_backend="triton", block_size=4, enforce_eager=True)
    assert isinstance(llm.llm_engine.executor.workers[0].model_runner.decode_strategy, GPUDecodeStack)
    with counting_stack_calls() as calls:
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 3 and not any(calls)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_stack_matches_transformers(arch, tmp_path):
    """Qwen3.5's Gated DeltaNet and gated-attention layers through the hybrid stack (gpu_hybrid_decode_stack.py;
    the MoE block behind its fused norm): every decode step takes it, greedy tokens equal transformers' and
    logprobs within 1e-4, with the recurrent state carried from the prefill into the stack's steps."""
    from transformers import AutoModelForCausalLM

    from novainfer import LLM, SamplingParams
    from novainfer.worker.gpu_hybrid_decode_stack import GPUHybridDecodeStack
    from novainfer.worker.gpu_hybrid_decode_stack import supports as hybrid_supports
    from tests.test_qwen3_5 import assert_matches
    from tests.tiny_hybrid import PROMPTS, build
    from tests.tiny_models import hf_greedy_logprobs

    path = build(str(tmp_path), arch)
    llm = LLM(path, dtype="float32", attention_backend="triton", block_size=4, enforce_eager=True)
    runner = llm.llm_engine.executor.workers[0].model_runner
    runner.decode_strategy = select_decode_strategy(runner.model, triton_backend, graphs_only=False)
    assert hybrid_supports(runner.model.model) and isinstance(runner.decode_strategy, GPUHybridDecodeStack)
    n = 6
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, n)
    with counting_stack_calls() as calls:
        for prompt, ref in zip(PROMPTS[:2], refs):
            assert_matches(llm.generate([prompt], params, use_tqdm=False), [ref])
    assert calls.count(True) == 2 * (n - 1) and calls.count(False) == 2

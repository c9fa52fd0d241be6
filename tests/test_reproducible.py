"""Greedy output is reproducible on the CPU defaults (issue 35, item 9): a request gets the same tokens, and the
same logprob bits, alone, in a batch of other prompts, on a prefix-cache hit, prefilled in chunks and recomputed
after preemption, with dense bfloat16 weights over a bfloat16 KV cache and with the default (quantized) model.

Logprobs are compared exactly: any bit that depends on the batch shows in them long before it flips a token.
"""

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.kernels.cpu import library, ops
from novainfer.layers.row_invariant import linear

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)


def answers(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and the logprob of each."""
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in outs
    ]


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 390, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "nh,nkv,d,length,window,cap",
    [(4, 2, 16, 40, None, None), (9, 3, 64, 600, None, None), (8, 1, 128, 530, 100, None), (6, 2, 32, 300, None, 30.0)],
)
def test_decode_attention_gives_a_query_its_prefill_bits(nh, nkv, d, length, window, cap):
    """The decode kernel's output for a query equals the prefill kernel's for the same position, whole prompt or
    chunk, over contexts split across cores (> 256 keys), a sliding window and a soft cap: a sequence recomputed
    after preemption continues exactly as it decoded."""
    g = torch.Generator().manual_seed(length)
    bs, nblk = 16, (length + 15) // 16 + 2
    kc = torch.randn(nblk, bs, nkv, d, generator=g).bfloat16()
    vc = torch.randn(nblk, bs, nkv, d, generator=g).bfloat16()
    table = torch.randperm(nblk, generator=g)[: (length + 15) // 16].to(torch.int32)[None]
    q = torch.randn(length, nh, d, generator=g)
    whole = ops.prefill_attention_bf16(
        q, kc, vc, table, torch.tensor([0, length]), torch.tensor([length]), 0.125, window, cap
    )
    for p in sorted({0, 1, 7, 16, 100, 255, 256, 257, length - 1} & set(range(length))):
        dec = ops.decode_attention_bf16(q[p : p + 1], kc, vc, table, torch.tensor([p + 1]), 0.125, window, cap)
        lo = max(0, p - 5)
        chunk = ops.prefill_attention_bf16(
            q[lo : p + 1], kc, vc, table, torch.tensor([0, p + 1 - lo]), torch.tensor([p + 1]), 0.125, window, cap
        )
        assert torch.equal(dec[0], whole[p]), p
        assert torch.equal(chunk[-1], whole[p]), p


def test_one_bfloat16_row_gets_the_bits_it_gets_among_others():
    """torch's one-row bf16 kernel sums in another order than its many-row one (here 6 of 43 rows differed)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=g).bfloat16()
    x = torch.randn(300, 1536, generator=g).bfloat16()
    many = linear(x, w)
    for i in range(0, 300, 7):
        assert torch.equal(linear(x[i], w), many[i]), i
        assert torch.equal(linear(x[i : i + 3], w)[0], many[i]), i


@pytest.fixture(scope="module")
def bf16_alone(tiny_qwen2):
    """The reference: each prompt on its own, no prefix cache, dense bf16 weights and bf16 KV."""
    llm = LLM(tiny_qwen2, dtype="bfloat16", cache_dtype="bfloat16", block_size=4, enable_prefix_caching=False)
    prompts = prompts_of([9, 23, 5, 31, 14, 40])
    return prompts, [answers(llm, [p])[0] for p in prompts]


def test_bf16_same_bits_in_a_batch_and_prefilled_in_chunks(tiny_qwen2, bf16_alone):
    prompts, alone = bf16_alone
    llm = LLM(tiny_qwen2, dtype="bfloat16", block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert answers(llm, prompts) == alone


def test_bf16_same_bits_on_a_prefix_cache_hit(tiny_qwen2, bf16_alone):
    prompts, alone = bf16_alone
    llm = LLM(tiny_qwen2, dtype="bfloat16", block_size=4, enable_prefix_caching=True)
    for p, ref in zip(prompts, alone):
        assert answers(llm, [p])[0] == ref  # a cold cache
        hit = llm.generate([p], PARAMS, use_tqdm=False)[0]
        assert hit.num_cached_tokens > 0 or len(p) < 8
        assert answers(llm, [p])[0] == ref  # all but the last block from the cache


def test_bf16_same_bits_after_preemption(tiny_qwen2, bf16_alone):
    prompts, alone = bf16_alone
    llm = LLM(tiny_qwen2, dtype="bfloat16", block_size=4, enable_prefix_caching=False, num_gpu_blocks=24)
    assert answers(llm, prompts) == alone
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_default_model_same_bits_after_preemption_and_on_a_prefix_hit():
    """The default model (quantized weights, float32 activations, bf16 KV): recomputing a preempted sequence
    runs its decoded tokens through the prefill kernel, which must give them their decode bits."""
    prompts = prompts_of([12, 30, 7, 21], seed=1)
    big = LLM(max_model_len=64, block_size=16, enable_prefix_caching=False)
    alone = [answers(big, [p])[0] for p in prompts]
    small = LLM(max_model_len=64, block_size=16, enable_prefix_caching=True, num_gpu_blocks=6)
    assert answers(small, prompts) == alone
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert answers(small, prompts[1:2]) == alone[1:2]  # its blocks are cached now


def test_batch_invariant_gemm_gives_a_row_the_same_bits_in_any_batch_interpreted():
    """The CUDA mode's fixed-tile GEMM (Triton, interpreted here in float32): a row alone equals it among 2, 3 and
    70 rows, and matches the float32 reference; tests/gpu/batch_invariance_check.py checks bf16 on a GPU."""
    pytest.importorskip("triton")
    from tests.gpu import batch_invariance_check as check

    check.rows.clear()
    check.kernel_check("cpu", torch.float32, 96, 130, [1, 2, 3, 70])
    assert len(check.rows) == 3 and all(ok is not False for *_, ok in check.rows), check.rows


def test_batch_invariant_refuses_what_it_cannot_make_invariant():
    from novainfer.config import EngineConfig

    for kw in ({"quantization": "fp8"}, {"tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="batch_invariant"):
            EngineConfig.from_kwargs("some-model", batch_invariant=True, **kw)
    assert EngineConfig.from_kwargs("some-model", batch_invariant=True).batch_invariant

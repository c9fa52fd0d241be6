"""Greedy decoding matches Hugging Face transformers token for token (float32, CPU)."""

import pytest

from novainfer import LLM, SamplingParams
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.usefixtures("step_loop")  # every test with the synchronous and the overlapped loop

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):"]


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen2_tied", "tiny_llama", "tiny_qwen3"])
def test_greedy_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(path, block_size=16, dtype="float32")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 40), prompt
        assert out.outputs[0].finish_reason == "length"


def test_batch_of_prompts_matches_each_alone(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", block_size=4)
    tok = llm.get_tokenizer()
    base = "The quick brown fox jumps over the lazy dog. Paged attention stores keys"
    prompts = [base[: 5 + 9 * i] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].token_ids == hf_greedy(tiny_qwen2, tok.encode(prompt), 24)


def test_prefix_caching_same_tokens_and_reports_hits(tiny_qwen2):
    shared = "Paged attention stores keys and values in fixed-size blocks of the cache. " * 3
    prompts = [shared + "Hello", shared + "The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = LLM(tiny_qwen2, dtype="float32", block_size=4, enable_prefix_caching=False)
    on = LLM(tiny_qwen2, dtype="float32", block_size=4, enable_prefix_caching=True)
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    first = on.generate(prompts[:1], params, use_tqdm=False)[0]
    second = on.generate(prompts[1:], params, use_tqdm=False)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == ref
    assert first.num_cached_tokens == 0
    n_shared = len(on.get_tokenizer().encode(shared))
    assert second.num_cached_tokens >= (n_shared // 4 - 1) * 4 > 0
    # a repeat of the same prompt is served from cache except its last block
    again = on.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref[0] and again.num_cached_tokens > n_shared - 8


def test_small_cache_preempts_and_matches(tiny_qwen2):
    prompts = [f"Hello, my name is {name} and" for name in ["Ann", "Bob", "Cy", "Dee", "Eve", "Fay"]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(tiny_qwen2, dtype="float32", block_size=4)
    ref = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    small = LLM(tiny_qwen2, dtype="float32", block_size=4, num_gpu_blocks=40)  # 160 tokens for 6 x ~50
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert small.llm_engine.block_manager.num_free_blocks == 40


def test_chunked_prefill_long_prompt(tiny_qwen2):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(tiny_qwen2, dtype="float32", block_size=4, max_num_batched_tokens=16)
    n = len(llm.get_tokenizer().encode(prompt))
    assert n > 16
    out = llm.generate([prompt, "Hello"], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_qwen2, llm.get_tokenizer().encode(prompt), 16)
    assert out[1].outputs[0].token_ids == hf_greedy(tiny_qwen2, llm.get_tokenizer().encode("Hello"), 16)


def test_unservable_prompts_are_rejected(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["word " * 100], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    # the engine keeps working afterwards
    assert llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="needs more KV cache"):
        LLM(tiny_qwen2, dtype="float32", block_size=4, num_gpu_blocks=4, max_model_len=64)


def test_max_model_len_stops_generation(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", block_size=4, max_model_len=20)
    out = llm.generate(
        [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 15 and out.outputs[0].finish_reason == "length"

"""The model families against Hugging Face transformers (float32, CPU): greedy tokens identical
for 40 new tokens and the chosen tokens' logprobs equal (which also checks what greedy cannot see, such as
Gemma 2's final logit soft-cap), on tiny random checkpoints saved with save_pretrained.

Each prompt set holds one prompt longer than the sliding window of the windowed models (tests/tiny_models.py
WINDOW); MoE models have more experts than top-k and routers scaled so routing is uneven. Tensor parallelism
(uni backend, threads) gives tp 1's tokens for one MoE and one Gemma model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from novainfer import LLM, SamplingParams
from novainfer.models.moe import num_experts_of
from novainfer.models.registry import MODEL_REGISTRY, get_model_class
from tests.tiny_models import FAMILIES, WINDOW, hf_greedy_logprobs, hf_greedy_with, make_tiny_model

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. The capital of France is"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two threads spin against
    other processes: one thread ran these tests about ten times faster here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family_path(tmp_path_factory):
    paths: dict[str, str] = {}

    def build(arch: str) -> str:
        if arch not in paths:
            paths[arch] = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, seed=17)
        return paths[arch]

    return build


def hf_reference(path: str, prompt_ids: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and the logprob of each, decoding token by token with its KV cache (as
    tests/tiny_models.hf_greedy_with, which a one-shot forward would not equal: LongRoPE switches tables)."""
    return hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompt_ids, n)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_greedy_and_logprobs_match_transformers(arch, family_path):
    path = family_path(arch)
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16)  # chunked prefill too
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert len(ids[1]) > 2 * WINDOW
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for (ref_tokens, ref_lps), out, prompt in zip(hf_reference(path, ids, 40), outs, PROMPTS):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, (arch, prompt)
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4, (arch, prompt)


@pytest.mark.parametrize("arch,backend", [("qwen2_moe", "uni"), ("gemma2", "uni")])  # mp: ~75 s here, left out
def test_tensor_parallel_two_ranks_equal_one(arch, backend, family_path):
    path = family_path(arch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(
            path,
            dtype="float32",
            block_size=4,
            tensor_parallel_size=tp,
            distributed_executor_backend=backend,
            master_port=0,
        )
        try:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    assert tokens[2] == tokens[1]


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_routing_is_uneven(arch, family_path, monkeypatch):
    """The tiny MoE checkpoints route unevenly (some experts far busier than others), so the parity tests
    exercise experts with many tokens, with one, and idle ones."""
    import novainfer.layers.fused_moe.layer as moe_layer

    chosen: list[torch.Tensor] = []
    select = moe_layer.select_experts
    monkeypatch.setattr(moe_layer, "select_experts", lambda *a: chosen.append(select(*a)[1]) or select(*a))
    llm = LLM(family_path(arch), dtype="float32", num_gpu_blocks=64)
    chosen.clear()  # the start-up profile run is not a prompt
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    num_experts = num_experts_of(llm.llm_engine.config.model_config.hf_config)
    counts = torch.bincount(torch.cat([c.flatten() for c in chosen]), minlength=num_experts)
    assert counts.max() >= 2 * max(int(counts.min()), 1), counts.tolist()


def test_one_all_reduce_per_moe_layer(family_path, monkeypatch):
    """tp=2 Qwen2-MoE: o_proj and the MoE block (routed + shared experts) reduce once each per layer."""
    from novainfer.distributed.parallel_state import ThreadGroup

    calls: list[int] = []
    reduce = ThreadGroup.all_reduce
    monkeypatch.setattr(ThreadGroup, "all_reduce", lambda self, x: calls.append(self.rank) or reduce(self, x))
    llm = LLM(family_path("qwen2_moe"), dtype="float32", tensor_parallel_size=2, num_gpu_blocks=32)
    calls.clear()
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    llm.llm_engine.shutdown()
    assert sorted(calls) == [0] * 4 + [1] * 4  # 2 layers (one MoE, one dense) x 2 reductions x 2 ranks


def test_triton_backend_window_and_soft_cap_in_the_engine(family_path):
    """Gemma 2 through the Triton kernels (interpreted on the CPU): window, soft-cap, chunked prefill, decode."""
    path = family_path("gemma2")
    llm = LLM(path, dtype="float32", attention_backend="triton", block_size=4, max_num_batched_tokens=16)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPTS[1:], params, use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert out.outputs[0].token_ids == hf_greedy_with(model, tok.encode(PROMPTS[1]), 8)


def test_registry_lists_every_family_and_refuses_the_rest():
    from types import SimpleNamespace

    for arch in (
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "MistralForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "GptOssForCausalLM",
    ):
        assert get_model_class(SimpleNamespace(architectures=[arch])) is MODEL_REGISTRY[arch]
    with pytest.raises(
        ValueError,
        match="unsupported model architecture.*supported: Gemma2ForCausalLM, "
        "Gemma3ForCausalLM, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, "
        "GptOssForCausalLM, LlamaForCausalLM, MistralForCausalLM",
    ):
        get_model_class(SimpleNamespace(architectures=["FalconForCausalLM"]))


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_core_api_slot_cache_honours_the_window(arch, family_path):
    """The llama.cpp-style Context (SLOT cache, visibility masks) with windowed, soft-capped layers: the prompt
    is longer than the window, then token by token; greedy tokens equal transformers'."""
    from novainfer.core import Context

    path = family_path(arch)
    ctx = Context(path, n_cells=64, dtype="float32", device="cpu")
    prompt = ctx.tokenizer.encode(PROMPTS[1])
    out, nxt = [], ctx.infer(prompt)
    for _ in range(10):
        out.append(nxt)
        nxt = ctx.infer([nxt])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert out == hf_greedy_with(model, prompt, 10)


def test_core_api_refuses_to_move_keys_of_per_layer_rope(family_path):
    """Gemma 3's sliding and global layers rotate with different bases: kv_seq_add cannot shift their keys
    with one rotation, so it refuses instead of corrupting the cache (Gemma 2 shares one base and may)."""
    from novainfer.core import Context

    for arch, moves in (("gemma3", False), ("gemma2", True)):
        ctx = Context(family_path(arch), n_cells=32, dtype="float32", device="cpu")
        ctx.infer(ctx.tokenizer.encode("Hello, my name is"))
        if moves:
            assert ctx.kv_seq_add(0, 0, -1, 3) == 0
        else:
            before = ctx.cache.pos.copy()
            with pytest.raises(NotImplementedError, match="per-layer rope bases"):
                ctx.kv_seq_add(0, 0, -1, 3)
            assert (ctx.cache.pos == before).all()  # refused before anything moved


def test_longrope_prompt_longer_than_the_original_length(family_path):
    """Phi-3's LongRoPE: a prompt already past original_max_position_embeddings (32 here) is rotated with the
    long factors from its first token on, as transformers does (one prefill chunk); logprobs show it."""
    path = family_path("phi3")
    llm = LLM(path, dtype="float32", block_size=4)
    prompt = llm.get_tokenizer().encode(PROMPTS[1] + " " + PROMPTS[0])
    assert 32 < len(prompt) < 32 + WINDOW  # the last token's window still reaches rows below 32
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ((ref_tokens, ref_lps),) = hf_reference(path, [prompt], 12)
    assert got.token_ids == ref_tokens
    assert max(abs(got.logprobs[i][t].logprob - lp) for i, (t, lp) in enumerate(zip(ref_tokens, ref_lps))) < 1e-4

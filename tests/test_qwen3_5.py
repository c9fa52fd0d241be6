"""Hybrid models (Gated DeltaNet + gated attention: Qwen3.5 dense and MoE, Qwen3-Next) against transformers,
float32 on the CPU, on tiny random checkpoints: greedy tokens identical and logprobs within 1e-4 for a batch of
mixed-length prompts in small chunks (the recurrent state carried across chunk boundaries, prefill chunks and
decodes in one step), each prompt alone, preemption under a tiny cache with fewer state slots than prompts,
prefix-cache hits restoring state checkpoints, tensor parallelism over the DeltaNet heads, a ForConditionalGeneration
checkpoint run as its language model; speculation, unknown layer types and the core API refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from novainfer import LLM, SamplingParams
from tests.tiny_hybrid import CONFIGS, PROMPTS, build
from tests.tiny_models import hf_greedy_logprobs

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only contend on the shared machine (as tests/test_model_families.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    paths: dict[str, str] = {}

    def get(arch: str, conditional: bool = False) -> str:
        key = f"{arch}-vl" if conditional else arch
        if key not in paths:
            paths[key] = build(str(tmp_path_factory.mktemp(key)), arch, conditional)
        return paths[key]

    return get


def assert_matches(outs, refs) -> None:
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_and_logprobs_match_transformers(arch, model_path):
    path = model_path(arch)
    # 6-token budget: the 20-token prompt spans four chunks, and decodes share steps with other prompts' chunks
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=6)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert len(ids[1]) > 12
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, N)
    assert_matches(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs)
    if arch == "qwen3_5":  # each prompt alone, in one long prefill step
        alone = LLM(path, dtype="float32", block_size=4)
        for prompt, ref in zip(PROMPTS, refs):
            assert_matches(alone.generate([prompt], GREEDY, use_tqdm=False), [ref])


def test_triton_attention_backend(model_path):
    """The gated attention layer through the Triton kernels (interpreted on the CPU), DeltaNet layers around it."""
    path = model_path("qwen3_5")
    llm = LLM(path, dtype="float32", attention_backend="triton", block_size=4, max_num_batched_tokens=4)
    ids = [llm.get_tokenizer().encode(PROMPTS[0])]  # two chunks, then decodes
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, 4)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(ids[0]) > 4 and out[0].outputs[0].token_ids == refs[0][0]
    assert llm.llm_engine.engine_core.executor.workers[0].model_runner.attn_backend.__name__.endswith("triton_backend")


def test_preemption_and_few_state_slots(model_path):
    """12 blocks of 4 tokens cannot hold three growing sequences: the newest is preempted (its slot freed, its
    state recomputed from zero); two slots for three prompts: the third waits for one."""
    path = model_path("qwen3_5_moe")
    llm = LLM(path, dtype="float32", block_size=4, num_gpu_blocks=12, max_num_seqs=2, max_num_batched_tokens=8)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, N)
    assert_matches(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs)
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    assert core.block_manager.num_state_slots == 2 and sorted(core.block_manager.free_slots) == [0, 1]


def test_prefix_cache_hits_restore_the_state_checkpoints(model_path):
    """A prompt that extends an earlier one hits the cache at the earlier prompt's last full block, whose state
    checkpoint is restored; a batch of prompts sharing a prefix (hits planned while their checkpoint is written in
    flight) too. Tokens and logprobs equal transformers', which has no cache across requests."""
    path = model_path("qwen3_5")
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=8)
    tok = llm.get_tokenizer()
    base = tok.encode(PROMPTS[1])
    assert len(base) > 16 and len(base) % 4
    prompts = [base, base + tok.encode(" Paris is"), base[:13] + tok.encode(" big"), base + tok.encode(" big")]
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompts, N)
    bm = llm.llm_engine.engine_core.block_manager
    assert_matches(llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False), refs[:1])
    assert bm.num_prefix_hits == 0 and len(bm.checkpoints) == 1
    assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False), refs[1:])
    # the two prompts that extend base hit at its checkpoint; the third shares 3 blocks, none checkpointed
    assert bm.num_prefix_hits == 2 * (len(base) // 4 * 4)


def test_state_slots_share_the_cpu_cache_budget(model_path):
    """The state slots and checkpoints take at most half of cpu_kv_cache_tokens' bytes; KV blocks the rest."""
    llm = LLM(model_path("qwen3_5"), dtype="float32", block_size=4, cpu_kv_cache_tokens=2048, max_num_seqs=64)
    core = llm.llm_engine.engine_core
    runner = core.executor.workers[0].model_runner
    state, budget = runner.state_cache, 2048 * runner.kv_bytes_per_block() // 4
    assert 0 < state.num_checkpoints < state.num_slots < 64 and 0 < state.nbytes() <= budget // 2
    assert core.num_blocks * runner.kv_bytes_per_block() + state.nbytes() <= budget
    assert core.block_manager.num_state_slots == state.num_slots
    assert core.block_manager.num_checkpoints == state.num_checkpoints


def test_conditional_generation_checkpoint_runs_as_language_model(model_path, caplog):
    path = model_path("qwen3_5", conditional=True)
    with caplog.at_level("INFO"):
        llm = LLM(path, dtype="float32", block_size=4)
    assert any("vision-tower weights" in r.getMessage() for r in caplog.records)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert_matches(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False), hf_greedy_logprobs(hf, ids, N))


def test_tensor_parallel_two_ranks_split_the_deltanet_heads(model_path):
    """tp=2 (uni backend, threads): each rank holds one key head and two value heads of every DeltaNet layer;
    Qwen3-Next's fused projections and the MoE are split too. Tokens and logprobs equal transformers'."""
    path = model_path("qwen3_next")
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=8)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, N)
    assert_matches(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False), refs)
    llm.llm_engine.shutdown()


def test_mp_backend_carries_the_state_slots(model_path):
    """The mp executor's step wire sends each sequence's slot and checkpoint copies to the worker process:
    chunked prompts, a prefix hit (the second prompt extends the first) and preemption, as transformers."""
    path = model_path("qwen3_5")
    llm = LLM(
        path,
        dtype="float32",
        distributed_executor_backend="mp",
        block_size=4,
        num_gpu_blocks=14,
        max_num_batched_tokens=8,
    )
    tok = llm.get_tokenizer()
    base = tok.encode(PROMPTS[1])
    prompts = [base, base + tok.encode(" Paris is"), tok.encode(PROMPTS[0])]
    refs = hf_greedy_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompts, N)
    assert_matches(llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False), refs[:1])
    assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False), refs[1:])
    core = llm.llm_engine.engine_core
    assert core.block_manager.num_prefix_hits > 0 and core.scheduler.num_preemptions > 0
    llm.llm_engine.shutdown()


def with_config(src: str, dst, **changes) -> str:
    """A copy of the checkpoint at src (links) whose config.json has the given fields changed."""
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), dst / name)
    config = json.load(open(os.path.join(src, "config.json")))
    config.update(changes)
    json.dump(config, open(dst / "config.json", "w"))
    return str(dst)


def test_tensor_parallel_refuses_indivisible_deltanet_heads(model_path, tmp_path):
    path = with_config(model_path("qwen3_5"), tmp_path, linear_num_key_heads=1)
    with pytest.raises(ValueError, match="linear_num_key_heads=1 is not divisible by tensor_parallel_size=2"):
        LLM(path, dtype="float32", tensor_parallel_size=2)


def test_core_api_refuses_hybrid_models(model_path):
    from novainfer.core.context import Context

    with pytest.raises(NotImplementedError, match="linear-attention"):
        Context(model_path("qwen3_5"), n_cells=64, dtype="float32")


def test_speculation_is_refused(model_path, tiny_qwen2):
    """On a hybrid target (a rejected guess would have advanced the recurrent state), and a hybrid draft model."""
    with pytest.raises(ValueError, match="recurrent state"):
        LLM(model_path("qwen3_5"), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="linear-attention layers, which a draft model cannot have"):
        LLM(
            tiny_qwen2,
            dtype="float32",
            speculative_config={"method": "draft_model", "model": model_path("qwen3_5"), "num_speculative_tokens": 2},
        )


def test_unknown_layer_type_is_refused(model_path, tmp_path):
    src = model_path("qwen3_5")
    types = json.load(open(os.path.join(src, "config.json")))["layer_types"]
    path = with_config(src, tmp_path, layer_types=["sliding_attention"] + types[1:])
    with pytest.raises(NotImplementedError, match="layer_types"):
        LLM(path, dtype="float32")


def test_ungated_attention_is_refused(model_path, tmp_path):
    path = with_config(model_path("qwen3_5"), tmp_path, attn_output_gate=False)
    with pytest.raises(NotImplementedError, match="attn_output_gate=False"):
        LLM(path, dtype="float32")


def test_a_bfloat16_state_cache_halves_the_state_and_keeps_the_tokens(model_path):
    """mamba_ssm_cache_dtype=bfloat16 (vLLM's flag): the recurrent states take bfloat16 slots, half the bytes
    (counted so in the cache budget), and greedy decoding of the float32 model stays with the float32-state run (logprobs
    within 5e-2: each step rounds the state once; 1.4e-2 seen)."""
    path = model_path("qwen3_5")
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype="float32", block_size=4, mamba_ssm_cache_dtype=dtype)
        runner = llm.llm_engine.engine_core.executor.workers[0].model_runner
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runs[dtype] = (runner.state_cache, outs)
    (cache32, outs32), (cache16, outs16) = runs["float32"], runs["bfloat16"]
    assert cache32.ssm.dtype == torch.float32 and cache16.ssm.dtype == torch.bfloat16
    ssm32 = cache32.ssm[:, 0].nbytes  # one slot's recurrent states over all layers
    assert cache16.ssm[:, 0].nbytes * 2 == ssm32 and cache32.bytes_per_slot() - cache16.bytes_per_slot() == ssm32 // 2
    for a, b in zip(outs32, outs16):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ga, gb = a.outputs[0], b.outputs[0]
        lps = [(ga.logprobs[i][t].logprob, gb.logprobs[i][t].logprob) for i, t in enumerate(ga.token_ids)]
        assert max(abs(x - y) for x, y in lps) < 5e-2
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        LLM(path, dtype="float32", mamba_ssm_cache_dtype="float16")

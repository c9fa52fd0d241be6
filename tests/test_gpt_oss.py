"""gpt-oss against transformers (float32, CPU), on a tiny random checkpoint saved with save_pretrained.

The checkpoint has every gpt-oss feature at once: sliding (window shorter than the prompts) and full layers,
YaRN rope with positions past original_max_position_embeddings, q/k/v/o biases, sinks drawn far from zero,
a router with a bias, experts with biases and a swiglu_limit small enough that the clamp bites. Greedy tokens
must equal transformers' and the chosen tokens' logprobs lie within 1e-4. The pieces (routing and experts, the
Triton MoE kernel with biases and the clamped SwiGLU, the rope tables) are checked on their own too.
The same checkpoint with its experts quantized to MXFP4 in the released on-disk layout runs against transformers
on its own dequantization of them, one rank and two, with the experts kept in four bits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP, GptOssRotaryEmbedding

from novainfer import LLM, SamplingParams
from novainfer.layers.activation import ClampedSwigluAndMul
from novainfer.layers.fused_moe import fused_experts_torch
from novainfer.layers.fused_moe.moe_torch import fused_experts_grouped
from novainfer.layers.fused_moe.routing import select_experts_top_logits
from novainfer.layers.rotary import get_rope
from tests.test_gemma4 import GREEDY, N, PROMPTS, assert_matches
from tests.test_model_families import one_thread  # noqa: F401  (autouse: one intra-op thread, as there)
from tests.tiny_models import WINDOW, hf_greedy_logprobs, make_tokenizer

LIMIT = 0.6  # swiglu_limit: small, so gates and ups of these weights pass it
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}


def tiny_config(vocab: int, eos: int, pad: int, **over) -> GptOssConfig:
    return GptOssConfig(
        **{
            **dict(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=16,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                max_position_embeddings=64,  # factor x original_max_position_embeddings, as YaRN expects
                rope_parameters=dict(YARN),
                swiglu_limit=LIMIT,
                initializer_range=0.1,
                eos_token_id=eos,
                pad_token_id=pad,
                bos_token_id=None,
                tie_word_embeddings=False,
            ),
            **over,
        }
    )


def randomize(model: torch.nn.Module) -> None:
    """Biases (attention, router, experts) and sinks drawn away from zero, norm weights off one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5 if name.endswith("bias") else 1.5)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0.0, 0.3)


def save_tiny(path, **over) -> str:
    tok = make_tokenizer(400)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(7)
    model = GptOssForCausalLM(tiny_config(len(tok), eos, tok.pad_token_id, **over)).float()
    model.config.architectures = ["GptOssForCausalLM"]
    randomize(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig(eos_token_id=[eos]).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gpt_oss"))


_REFS: dict[str, list] = {}


def reference(path: str, ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    if path not in _REFS:
        model = GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _REFS[path] = hf_greedy_logprobs(model, ids, N)
    return _REFS[path]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batch_and_alone_match_transformers(tiny, prefix_caching):
    """A batch of mixed lengths (one prompt past twice the window and past YaRN's original length, chunked
    prefill), then each prompt alone (with prefix caching, after the batch: cached prefixes reused)."""
    llm = LLM(tiny, dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert len(ids[1]) > 2 * WINDOW and len(ids[1]) + N > YARN["original_max_position_embeddings"]
    refs = reference(tiny, ids)
    assert_matches(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs)
    for prompt, ref in zip(PROMPTS, refs):
        assert_matches(llm.generate([prompt], GREEDY, use_tqdm=False), [ref])


def test_preemption_under_a_tiny_cache(tiny):
    prompts = [f"Hello, my name is {name} and" for name in ["Ann", "Bob", "Cy", "Dee"]]
    llm = LLM(tiny, dtype="float32", block_size=4, num_gpu_blocks=24)  # 96 tokens for 4 x ~35
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    model = GptOssForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t for t, _ in hf_greedy_logprobs(model, ids, N)]
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_tensor_parallel_two_ranks_match_transformers(tiny):
    """tp=2 (uni backend, threads): heads, KV heads, sinks, experts' intermediate size and biases split (the
    down bias on rank 0 only); tokens and logprobs as transformers'."""
    llm = LLM(
        tiny, dtype="float32", block_size=4, tensor_parallel_size=2, distributed_executor_backend="uni", master_port=0
    )
    try:
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        assert_matches(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference(tiny, ids))
        ranks = [w.model_runner.model for w in llm.llm_engine.executor.workers]
        hf = GptOssForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        sinks = hf.model.layers[1].self_attn.sinks
        assert torch.equal(torch.cat([m.model.layers[1].self_attn.sinks for m in ranks]), sinks)
        down = [m.model.layers[0].mlp.experts.w2_bias for m in ranks]
        assert torch.equal(down[0], hf.model.layers[0].mlp.experts.down_proj_bias) and not down[1].any()
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_refuses_indivisible_kv_heads(tmp_path):
    path = save_tiny(tmp_path, num_key_value_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads must be divisible by tensor_parallel_size"):
        LLM(path, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="uni", master_port=0)


def test_refuses_other_quantization_naming_the_field(tmp_path):
    """quantization_config of a method other than mxfp4, or mxfp4 asking for more than the experts, is refused at
    start-up naming the field, not loaded wrong."""
    path = save_tiny(tmp_path / "bnb", quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="quantization_config.quant_method='bitsandbytes'"):
        LLM(path, dtype="float32", num_gpu_blocks=8)
    path = save_tiny(tmp_path / "mx", quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []})
    with pytest.raises(ValueError, match="quantization_config.modules_to_not_convert"):
        LLM(path, dtype="float32", num_gpu_blocks=8)


def test_triton_attention_backend_matches_transformers(tiny):
    """The Triton paged-attention kernels (interpreted on the CPU) with sinks and the window: chunked prefill
    past the window, then decode."""
    llm = LLM(tiny, dtype="float32", attention_backend="triton", block_size=4, max_num_batched_tokens=16)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    out = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference(tiny, ids)[1][0][:6]


def hf_mlp_case(seed: int, tokens: int):
    """transformers' GptOssMLP with random weights and biases, its inputs, and the same weights as FusedMoE
    holds them (gate rows then up rows, de-interleaved; [out, in])."""
    torch.manual_seed(seed)
    cfg = tiny_config(64, 1, 0)
    mlp = GptOssMLP(cfg)
    randomize(mlp)
    with torch.no_grad():
        mlp.router.weight.normal_(0.0, 1.0)
    ex = mlp.experts
    gu = ex.gate_up_proj.detach()
    w13 = torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    b13 = torch.cat([ex.gate_up_proj_bias[..., ::2], ex.gate_up_proj_bias[..., 1::2]], dim=-1).detach()
    w2 = ex.down_proj.detach().transpose(1, 2).contiguous()
    x = torch.randn(tokens, cfg.hidden_size)
    return cfg, mlp, x, (w13, w2, b13, ex.down_proj_bias.detach())


def test_routing_and_experts_match_transformers():
    """Top-k logits softmaxed among themselves; biased experts with the clamped SwiGLU (the clamp bites on both
    sides); the loop and the grouped torch paths."""
    cfg, mlp, x, (w13, w2, b13, b2) = hf_mlp_case(0, 13)
    with torch.no_grad():
        want, hf_scores = mlp(x[None])
        _, _, hf_ids = mlp.router(x)
    weights, ids = select_experts_top_logits(x @ mlp.router.weight.t() + mlp.router.bias, cfg.num_experts_per_tok)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_scores, atol=1e-7)
    gate_up = torch.einsum("th,eoh->teo", x, w13) + b13
    gate, up = gate_up.chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up < -LIMIT).any() and (up > LIMIT).any()
    act = ClampedSwigluAndMul(cfg.swiglu_alpha, cfg.swiglu_limit)
    for experts in (fused_experts_torch, fused_experts_grouped):
        got = experts(x, w13, w2, weights, ids, act, b13, b2)
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9])
def test_triton_fused_moe_with_biases_and_clamped_swiglu_matches_torch(tokens):
    """The grouped-GEMM kernel's bias epilogue and the clamped-SwiGLU kernel (TRITON_INTERPRET=1 on the CPU)."""
    kernels = pytest.importorskip("novainfer.kernels.fused_moe")
    cfg, mlp, x, (w13, w2, b13, b2) = hf_mlp_case(1, tokens)
    weights, ids = select_experts_top_logits(mlp.router(x)[0].detach(), cfg.num_experts_per_tok)
    act = ClampedSwigluAndMul(cfg.swiglu_alpha, cfg.swiglu_limit)
    ref = fused_experts_torch(x, w13, w2, weights, ids, act, b13, b2)
    out = kernels.fused_experts(x, w13, w2, weights, ids, act, b13, b2)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    gate_up = torch.randn(5, 2 * 24) * 2
    torch.testing.assert_close(kernels.clamped_swiglu_and_mul(gate_up, 1.702, LIMIT), act(gate_up))


def test_yarn_rope_tables_match_transformers():
    """The rope module's cos/sin (YaRN: interpolated frequencies, attention scaling) at positions on both sides
    of original_max_position_embeddings equal transformers' gpt-oss rotary embedding."""
    cfg = tiny_config(64, 1, 0)
    rope = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg, "full_attention")
    positions = torch.tensor([[0, 3, 15, 16, 17, 40, 63]])
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    half = cfg.head_dim // 2
    torch.testing.assert_close(rope.cos_cache[positions[0], :half], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[positions[0], :half], sin[0], rtol=0, atol=1e-6)
    plain = get_rope(cfg.head_dim, cfg.max_position_embeddings, tiny_config(64, 1, 0, rope_parameters=None))
    assert not torch.allclose(plain.cos_cache[40], rope.cos_cache[40])


def test_core_api_context(tiny):
    """The llama.cpp-style Context (SLOT cache, the masked attention with sinks): a prompt past the window,
    then token by token, as transformers."""
    from novainfer.core import Context

    ctx = Context(tiny, n_cells=64, dtype="float32", device="cpu")
    ids = [ctx.tokenizer.encode(p) for p in PROMPTS]
    out, nxt = [], ctx.infer(ids[1])
    for _ in range(6):
        out.append(nxt)
        nxt = ctx.infer([nxt])
    assert out == reference(tiny, ids)[1][0][:6]


def test_bf16_cache_runs_the_c_attention_kernels_with_sinks(tiny, monkeypatch):
    """float32 activations over a bfloat16 cache take the C decode and prefill kernels (given the sinks); tokens
    equal transformers' and logprobs stay within the cache's rounding (5e-3)."""
    from novainfer.kernels.cpu import library, ops

    if not library.available():
        pytest.skip("the C kernels need a compiler and AVX2")
    seen = {"decode": 0, "prefill": 0}

    def spy(kind, fn, at):
        def wrapped(*args):
            seen[kind] += args[at] is not None
            return fn(*args)

        return wrapped

    monkeypatch.setattr(ops, "decode_attention_bf16", spy("decode", ops.decode_attention_bf16, 8))
    monkeypatch.setattr(ops, "prefill_attention_bf16", spy("prefill", ops.prefill_attention_bf16, 9))
    llm = LLM(tiny, dtype="float32", cache_dtype="bfloat16", block_size=4, max_num_batched_tokens=16)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    for out, (tokens, lps) in zip(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference(tiny, ids)):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert max(abs(got.logprobs[i][t].logprob - lp) for i, (t, lp) in enumerate(zip(tokens, lps))) < 5e-3
    assert seen["decode"] > 0 and seen["prefill"] > 0


# ---- MXFP4 experts (the released checkpoints' format) ------------------------------------------------------------

MX_INTER = 64  # MXFP4 blocks are 32 wide: the intermediate size per tp rank must be whole blocks
# the C MXFP4 GEMMs round activations to int16 per 32 (test_mxfp4: ~1e-4 relative a GEMM): 7e-5 measured here,
# 3.5e-4 on a checkpoint of random codes (larger weights)
C_KERNEL_LOGPROB_TOL = 5e-4


def save_tiny_mxfp4(path) -> str:
    """save_tiny's checkpoint (intermediate size 64) with the experts quantized to MXFP4 and stored as the released
    checkpoints store them: gate_up_proj_blocks [E, 2I, hidden/32, 16] / _scales (output rows gate/up interleaved),
    down_proj_blocks / _scales, quantization_config quant_method mxfp4; biases stay float."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from novainfer.layers.quantization.mxfp4 import quantize_mxfp4
    from novainfer.loader.gguf_gpt_oss import QUANTIZATION_CONFIG

    save_tiny(path, intermediate_size=MX_INTER)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, in, out] -> per output row
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = QUANTIZATION_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture(scope="module")
def tiny_mxfp4(tmp_path_factory):
    return save_tiny_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def mxfp4_reference(path: str, ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and logprobs with the checkpoint's experts dequantized on load (its own
    convert_moe_packed_tensors), float32 on the CPU."""
    from transformers import Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    key = path + ":mxfp4"
    if key not in _REFS:
        model = GptOssForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
        ).eval()
        from safetensors import safe_open

        with safe_open(f"{path}/model.safetensors", "pt") as f:  # the reference runs the stored values exactly
            p = "model.layers.0.mlp.experts.gate_up_proj"
            want = convert_moe_packed_tensors(
                f.get_tensor(p + "_blocks"), f.get_tensor(p + "_scales"), dtype=torch.float32
            )
        assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, want)
        _REFS[key] = hf_greedy_logprobs(model, ids, N)
    return _REFS[key]


def assert_tokens_and_logprobs(outs, refs, tol: float) -> None:
    for out, (tokens, lps) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert max(abs(got.logprobs[i][t].logprob - lp) for i, (t, lp) in enumerate(zip(tokens, lps))) < tol


def expert_bits_per_weight(model: torch.nn.Module) -> list[float]:
    """Each FusedMoE layer's expert-weight bytes (its parameters but the biases, and the CPU's repacked panels
    where it holds them) x 8 per expert weight."""
    from novainfer.layers.fused_moe import FusedMoE

    bits = []
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE)):
        stored = sum(p.nbytes for n, p in layer.named_parameters() if not n.endswith("bias"))
        stored += sum(w.nbytes() for part in (layer.mxfp4_packed or ()) for w in part)
        weights = layer.num_experts * 3 * layer.local_inter * layer.w2_bias.shape[1]
        bits.append(stored * 8 / weights)
    return bits


@pytest.mark.parametrize("c_kernels", [True, False])
def test_mxfp4_experts_match_transformers_dequantized(tiny_mxfp4, c_kernels, monkeypatch):
    """The MXFP4 checkpoint against transformers on its own dequantization: greedy tokens equal; logprobs within
    1e-4 where the experts dequantize in torch (no C kernels: float32 as the reference), within
    C_KERNEL_LOGPROB_TOL through the C MXFP4 GEMMs (int16 activations per 32). The experts stay four bits: 4.25
    bits a weight as loaded (blocks + e8m0 scales), 4.5 once repacked into the C kernels' panels (float16 scales)."""
    from novainfer.kernels.cpu import library

    if c_kernels and not library.available():
        pytest.skip("the C kernels need a compiler and AVX2")
    if not c_kernels:
        monkeypatch.setattr(library, "available", lambda: False)
    llm = LLM(tiny_mxfp4, dtype="float32", block_size=4, max_num_batched_tokens=16)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_tokens_and_logprobs(outs, mxfp4_reference(tiny_mxfp4, ids), C_KERNEL_LOGPROB_TOL if c_kernels else 1e-4)
    model = llm.llm_engine.executor.workers[0].model_runner.model
    experts = model.model.layers[0].mlp.experts
    assert not hasattr(experts, "w13_weight") and (experts.mxfp4_packed is not None) == c_kernels
    assert expert_bits_per_weight(model) == [4.5 if c_kernels else 4.25] * len(model.model.layers)


def test_mxfp4_tensor_parallel_two_ranks_match_transformers(tiny_mxfp4):
    """tp=2 with MXFP4 experts: each rank keeps its half of gate, of up (from the interleaved rows) and of down's
    blocks, the down bias on rank 0; tokens as transformers' on the dequantized weights."""
    llm = LLM(
        tiny_mxfp4,
        dtype="float32",
        block_size=4,
        tensor_parallel_size=2,
        distributed_executor_backend="uni",
        master_port=0,
    )
    try:
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_tokens_and_logprobs(outs, mxfp4_reference(tiny_mxfp4, ids), C_KERNEL_LOGPROB_TOL)
        ranks = [w.model_runner.model for w in llm.llm_engine.executor.workers]
        for m in ranks:
            assert expert_bits_per_weight(m)[0] in (4.25, 4.5)
        down = [m.model.layers[0].mlp.experts.w2_bias for m in ranks]
        assert down[0].any() and not down[1].any()
    finally:
        llm.llm_engine.shutdown()

"""Gemma 4 against transformers (float32, CPU), on tiny random checkpoints saved with save_pretrained.

The dense model has every text feature at once: per-layer embeddings, KV-shared layers (each reading the last
earlier layer of its type, one of two sliding candidates) with double-wide MLPs, attention_k_eq_v with wider
KV heads on full layers (global_head_dim, proportional partial rope), a sliding window shorter than the
prompts, soft-capped logits. The MoE model adds the router and experts beside the dense MLP. Norm weights,
layer scalars and router scales are drawn away from one, so each is seen. Greedy tokens must equal
transformers' and the chosen tokens' logprobs lie within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    GenerationConfig,
)

from novainfer import LLM, SamplingParams
from tests.test_model_families import one_thread  # noqa: F401  (autouse: one intra-op thread, as there)
from tests.tiny_models import WINDOW, hf_greedy_logprobs, make_tokenizer

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "def add(a, b):",
]
N = 24
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def text_config(moe: bool, vocab: int, eos: int, pad: int, **over) -> Gemma4TextConfig:
    """The tiny dense (PLE, KV sharing) or MoE config."""
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        final_logit_softcapping=3.0,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        tie_word_embeddings=True,
        vocab_size_per_layer_input=vocab,
    )
    if moe:
        extra = dict(
            num_hidden_layers=3,
            layer_types=LAYER_TYPES[:3],
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=5,
            top_k_experts=2,
            moe_intermediate_size=16,
        )
    else:
        extra = dict(
            num_hidden_layers=5,
            layer_types=LAYER_TYPES,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
        )
    return Gemma4TextConfig(**{**common, **extra, **over})


def randomize(model: torch.nn.Module) -> None:
    """Norm weights, layer scalars and router scales off one; routers decisive, so routing is uneven."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.normal_(1.0, 0.2)
            elif name.endswith("router.proj.weight"):
                p.mul_(3.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)


def save_tiny(path, moe: bool, multimodal: bool = False, **over) -> str:
    """A tiny Gemma4ForCausalLM checkpoint, or with multimodal a Gemma4ForConditionalGeneration one with a
    one-layer vision tower (weights under model.language_model.*)."""
    tok = make_tokenizer(400)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(5)
    config = text_config(moe, len(tok), eos, tok.pad_token_id, **over)
    if multimodal:
        vision = Gemma4VisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        )
        config = Gemma4Config(text_config=config.to_dict(), vision_config=vision.to_dict(), audio_config=None)
    model = (Gemma4ForConditionalGeneration if multimodal else Gemma4ForCausalLM)(config).float()
    model.config.architectures = [type(model).__name__]
    randomize(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig(eos_token_id=[eos]).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gemma4_dense"), moe=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gemma4_moe"), moe=True)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    return hf_greedy_logprobs(model, [ids], n)[0][0]


_REFS: dict[str, list] = {}


def reference(path: str, ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    if path not in _REFS:
        model = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _REFS[path] = hf_greedy_logprobs(model, ids, N)
    return _REFS[path]


def assert_matches(outs, refs) -> None:
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("which", ["dense", "moe"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batch_and_alone_match_transformers(which, prefix_caching, request):
    """A batch of mixed lengths (one prompt past twice the window, chunked prefill), then each prompt alone
    (with prefix caching, after the batch: cached prefixes reused), all equal transformers'."""
    path = request.getfixturevalue(which)
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert len(ids[1]) > 2 * WINDOW
    refs = reference(path, ids)
    assert_matches(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs)
    for prompt, ref in zip(PROMPTS, refs):
        assert_matches(llm.generate([prompt], GREEDY, use_tqdm=False), [ref])


def test_preemption_under_a_tiny_cache(dense):
    prompts = [f"Hello, my name is {name} and" for name in ["Ann", "Bob", "Cy", "Dee"]]
    llm = LLM(dense, dtype="float32", block_size=4, num_gpu_blocks=24)  # 96 tokens for 4 x ~35
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    model = Gemma4ForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, i, N) for i in ids]
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_kv_shared_layers_read_their_source_and_hold_no_cache(dense):
    """Layers 3 (sliding) and 4 (full) read layers 1 and 2, the last earlier ones of their types (not layer
    0); only the three computing layers hold a cache, full layers with their own KV head size."""
    llm = LLM(dense, dtype="float32", block_size=4, num_gpu_blocks=16)
    runner = llm.llm_engine.executor.workers[0].model_runner
    layers = runner.model.model.layers
    attn = [layer.self_attn.attn for layer in layers]
    assert attn[3].kv_source is attn[1] and attn[4].kv_source is attn[2]
    assert [a.kv_source is None for a in attn] == [True, True, True, False, False]
    assert attn[3].k_cache.numel() == attn[4].k_cache.numel() == 0
    assert attn[0].k_cache.shape == (16, 4, 4, 16) and attn[2].k_cache.shape == (16, 4, 2, 32)
    # the grouped cache (worker/kv_layout.py): each computing layer is a KV group of its own with its own block
    # table over one pool, whose block is one layer's K and V of 4 tokens in float32 (4 x 16 = 2 x 32 values)
    assert sorted(a.kv_group for a in attn[:3]) == [0, 1, 2] and attn[2].kv_group == 0
    assert runner.kv_bytes_per_block() == 2 * 4 * 4 * (4 * 16)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_tensor_parallel_two_ranks_match_transformers(which, request):
    """tp=2 (uni backend, threads): heads, KV heads of both layer kinds, MLPs (double-wide too) and experts
    split; PLE tables, routers and KV-shared layers' sources per rank; tokens and logprobs as transformers'."""
    path = request.getfixturevalue(which)
    llm = LLM(
        path, dtype="float32", block_size=4, tensor_parallel_size=2, distributed_executor_backend="uni", master_port=0
    )
    try:
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        assert_matches(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference(path, ids))
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_refuses_indivisible_full_layer_kv_heads(tmp_path):
    """The full layers' own KV head count (num_global_key_value_heads) must split too."""
    path = save_tiny(tmp_path, moe=False, num_global_key_value_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by tp_size=2"):
        LLM(path, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="uni", master_port=0)


def test_refuses_what_it_does_not_implement(tmp_path):
    """A config field whose meaning this model does not run fails at start-up, naming it."""
    from novainfer.models.gemma4 import check_supported

    path = save_tiny(tmp_path, moe=False, use_bidirectional_attention="all")
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        LLM(path, dtype="float32", num_gpu_blocks=8)
    per_layer = text_config(False, 400, 1, 0, per_layer_config={2: {"head_dim": 32, "intermediate_size": 8}})
    with pytest.raises(NotImplementedError, match="per_layer_config overrides.*intermediate_size"):
        check_supported(per_layer)


def test_multimodal_checkpoint_runs_as_its_language_model(tmp_path, caplog):
    """Gemma4ForConditionalGeneration: the text config and the model.language_model.* weights; the vision
    tower's weights are skipped with one log line; text-only greedy tokens equal transformers'."""
    path = save_tiny(tmp_path, moe=False, multimodal=True)
    with caplog.at_level("INFO", logger="novainfer.models.gemma4"):
        llm = LLM(path, dtype="float32", block_size=4, num_gpu_blocks=32)
    assert [r.message for r in caplog.records if "vision/audio" in r.message] == [
        "Gemma 4: skipped 16 vision/audio weights (the language model runs alone)"
    ]
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    got = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    model = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert got[0].outputs[0].token_ids == hf_greedy(model, ids, 12)


GEMMA_TEMPLATE = (
    "{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def test_chat_template_and_end_of_turn_stop(tmp_path):
    """LLM.chat renders the checkpoint's own template (through transformers); the end-of-turn token listed in
    generation_config's eos ids ends the reply. Its LM-head row is made 1.01x that of the token transformers
    picks at step 4, so greedy decoding reaches it within four tokens."""
    tok = make_tokenizer(400)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>"]})
    tok.chat_template = GEMMA_TEMPLATE
    eos, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<turn|>")
    torch.manual_seed(5)
    model = Gemma4ForCausalLM(text_config(False, len(tok), eos, tok.pad_token_id, tie_word_embeddings=False))
    model.config.architectures = ["Gemma4ForCausalLM"]
    randomize(model)
    messages = [{"role": "user", "content": "The capital of France is"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|turn>user\nThe capital of France is<turn|>\n<|turn>model\n"
    with torch.no_grad():
        model.lm_head.weight[eot] = 1.01 * model.lm_head.weight[hf_greedy(model.eval(), ids, 4)[3]]
    ref = hf_greedy(model, ids, 8)
    assert eot in ref[:4]
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=[eos, eot]).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_gpu_blocks=32)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref[: ref.index(eot) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_triton_backend_reads_shared_caches(dense):
    """The Triton kernels (interpreted on the CPU) over the mixed-shape cache and the KV-shared layers:
    chunked prefill past the window, then decode; tokens as transformers'."""
    llm = LLM(dense, dtype="float32", attention_backend="triton", block_size=4, max_num_batched_tokens=16)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    out = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference(dense, ids)[1][0][:6]


def test_core_api_context(dense):
    """The llama.cpp-style Context (SLOT cache: one cell per token) with the mixed-shape cache and KV-shared
    layers: a prompt past the window, then token by token; moving keys is refused (rope differs per layer)."""
    from novainfer.core import Context

    ctx = Context(dense, n_cells=64, dtype="float32", device="cpu")
    ids = [ctx.tokenizer.encode(p) for p in PROMPTS]
    out, nxt = [], ctx.infer(ids[1])
    for _ in range(6):
        out.append(nxt)
        nxt = ctx.infer([nxt])
    assert out == reference(dense, ids)[1][0][:6]
    with pytest.raises(NotImplementedError, match="per-layer rope bases"):
        ctx.kv_seq_add(0, 0, -1, 3)

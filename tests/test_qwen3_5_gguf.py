"""Qwen3.5 GGUF files made by llama.cpp's own converter (and quantizer) from a tiny random HF checkpoint with two
key heads serving four value heads (so the converter's value-head reordering bites): the f32 file (dense and
MoE) gives the HF checkpoint's and transformers' greedy tokens; the Q8_0 / Q4_K_M files, kept quantized, agree
with the float32 reference on their own dequantized weights in >= 99% of teacher-forced top-1 tokens and, where
llama_cpp is installed, are no further from it in KL than llama.cpp is on the same file; the MoE's Q8_0 experts
stay blocks with the one-GPU GGUF config; unknown metadata is refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gguf_checkpoint import (
    QWEN35_SHAPES,
    convert_side_by_side,
    llama_cpp_converter,
    llama_quantize,
    write_qwen35_hf,
)
from novainfer.kernels.cpu import library
from tests.test_qwen3_5 import one_thread  # noqa: F401  (the module's autouse fixture: one torch thread)

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
PROMPT = [5, 9, 300, 7, 150, 12, 44, 80]
N = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if llama_cpp_converter() is None:
        pytest.skip("llama.cpp's converter (llama-cpp-python sdist) could not be fetched")
    root = tmp_path_factory.mktemp("qwen35-gguf")
    hf = write_qwen35_hf(str(root / "hf"), QWEN35_SHAPES["tiny"])
    moe = write_qwen35_hf(str(root / "moe-hf"), QWEN35_SHAPES["tiny-moe"])
    dense, experts = convert_side_by_side(
        [
            (hf, {"f32": str(root / "f32.gguf"), "q8_0": str(root / "q8_0.gguf")}),
            (moe, {"f32": str(root / "moe-f32.gguf"), "q8_0": str(root / "moe-q8_0.gguf")}),
        ]
    )
    return {"hf": hf, **dense, "moe-hf": moe, "moe-f32": experts["f32"], "moe-q8_0": experts["q8_0"]}


@pytest.mark.parametrize("model", ["", "moe-"], ids=["qwen35", "qwen35moe"])
def test_f32_gguf_greedy_matches_its_hf_checkpoint_and_transformers(model, files):
    from transformers import AutoModelForCausalLM

    from novainfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    greedy = {}
    for key in ("f32", "hf"):
        llm = LLM(files[model + key], dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=5)
        greedy[key] = list(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)
        llm.llm_engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(files[model + "hf"], dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0]
    assert greedy["f32"] == greedy["hf"] == ref[len(PROMPT) :].tolist()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
def test_quantized_file_agrees_with_its_float32_reference(qtype, files, tmp_path):
    from benchmarks.quant_accuracy import against_float32_reference

    if qtype == "q4_k_m":
        pytest.importorskip("llama_cpp")  # llama.cpp's quantizer; not a test dependency
        path = llama_quantize(files["f32"], str(tmp_path / "q4_k_m.gguf"), "Q4_K_M")
    else:
        path = files[qtype]
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(3, 400, (128,), generator=g).tolist() for _ in range(2)]
    (kl, top1), llama = against_float32_reference(path, chunks)
    assert top1 >= 0.99, (kl, top1)
    assert llama is None or kl <= llama[0], (kl, top1, llama)


def test_weights_stay_quantized_and_reordered_blocks_load(files):
    """Q8_0 keeps the DeltaNet projections quantized, out_proj too (its value heads span whole 32-blocks, so the
    column reorder moves blocks); the 4-row alpha / beta projections load dense."""
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = files["q8_0"]
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    mixer = model.model.layers[0].linear_attn
    for proj in (mixer.in_proj_qkv, mixer.in_proj_z, mixer.out_proj):
        assert proj.weight.packed is not None
    assert mixer.in_proj_a.weight.packed is None and mixer.in_proj_b.weight.packed is None
    dense = load_model(files["f32"], load_hf_config(files["f32"]), torch.float32, torch.device("cpu"))
    want = dense.model.layers[0].linear_attn.out_proj.weight
    got = mixer.out_proj.weight.packed.dequantize()
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # Q8_0 rounding, in the HF column order


@pytest.fixture(scope="module")
def moe_q8_0(files):
    """The MoE checkpoint through llama.cpp's converter at q8_0: its ffn_*_exps stacks Q8_0 (one test's file)."""
    return files["moe-q8_0"]


def test_moe_experts_stay_quantized_with_the_gpu_config(moe_q8_0):
    """The one-GPU GGUF config keeps the MoE's Q8_0 expert stacks as blocks (tests/test_gguf_moe_gpu.py's check)."""
    from tests.test_gguf_moe_gpu import check_experts_kept

    check_experts_kept(moe_q8_0, lambda layer: layer.mlp.experts)


def test_unknown_qwen35_metadata_is_refused(files, monkeypatch):
    from novainfer.loader import gguf_loader

    monkeypatch.setitem(gguf_loader._reader(files["f32"]).metadata, "qwen35.rope.scaling.type", "yarn")
    with pytest.raises(NotImplementedError, match="qwen35.rope.scaling.type"):
        gguf_loader.load_gguf_config(files["f32"])


@pytest.mark.parametrize("path", ["stack", "decoder-layers", "mixer"])
def test_decode_layers_in_one_c_call_match_the_layer_path(path, files, monkeypatch):
    """Q8_0 weights stay packed, so a decode step runs in C: the whole decoder stack in one call
    (kernels/cpu/hybrid_stack.py), or each decoder layer as one call where the stack is off: the DeltaNet ones (norms,
    mixer and MLP: kernels/cpu/gdn_layer.py; the mixer alone where the layer's MLP is not the dense one, here forced,
    which also leaves the stack out) and the gated-attention ones (kernels/cpu/gated_attn_layer.py). A batch of two
    prompts of different lengths decodes, through the stack, the same tokens and logprobs to the bit as through the
    per-layer calls (the same kernels), and the same greedy tokens, logprobs within 2e-3, as the layer-by-layer path
    (the C calls disabled). Not to the bit: the gates' exp / softplus / sigmoid and the small dense b / a products
    are C's, not torch's; the next layer's int8 activation quantization turns their last-bit differences into a
    rounding step here and there (1e-4 to 5e-4 in a logprob on this random model)."""
    from novainfer import LLM, SamplingParams
    from novainfer.kernels.cpu import gated_attn_layer, gdn_layer, hybrid_stack
    from novainfer.models import qwen3_5_cpu_decode
    from novainfer.worker import cpu_hybrid_stack

    calls = {"stack": [], "gdn": [], "attn": []}

    def counting(cls, name, key):
        run = getattr(cls, name)

        def counted(self, *args):
            calls[key].append(args[0].shape[0])
            return run(self, *args)

        monkeypatch.setattr(cls, name, counted)

    def generate():
        for v in calls.values():
            v.clear()
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    counting(hybrid_stack.HybridStackKernel, "run", "stack")
    counting(gdn_layer.GDNLayerKernel, "run" if path == "mixer" else "run_layer", "gdn")
    counting(gated_attn_layer.GatedAttnLayerKernel, "run", "attn")
    if path == "mixer":
        monkeypatch.setattr(qwen3_5_cpu_decode, "norms_and_mlp_supported", lambda *args: False)
    if path != "stack":
        monkeypatch.setattr(cpu_hybrid_stack.CPUHybridStack, "forward", lambda self, *args: None)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [3, 77, 78]}]
    llm = LLM(files["q8_0"], max_model_len=256, block_size=4, enable_prefix_caching=False)
    fast = generate()
    if path == "stack":
        assert 2 in calls["stack"] and not calls["gdn"] and not calls["attn"]  # both decode rows, every layer
        monkeypatch.setattr(cpu_hybrid_stack.CPUHybridStack, "forward", lambda self, *args: None)
        per_layer = generate()
        assert not calls["stack"] and 2 in calls["gdn"] and 2 in calls["attn"]
        assert [(o.token_ids, o.logprobs) for o in per_layer] == [(o.token_ids, o.logprobs) for o in fast]
    else:
        assert not calls["stack"] and 2 in calls["gdn"]
        assert (2 in calls["attn"]) == (path == "decoder-layers")
    monkeypatch.setattr(gdn_layer, "layer_kernel", lambda *layers: None)
    monkeypatch.setattr(qwen3_5_cpu_decode, "gated_attn_kernel", lambda decoder: None)
    slow = generate()
    assert not calls["stack"] and not calls["gdn"] and not calls["attn"]
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        for t, la, lb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(la[t].logprob - lb[t].logprob) < 2e-3


def test_a_bad_kv_index_stops_the_stack_before_any_state_moves(files, monkeypatch):
    """The whole-stack call checks a step's KV slots before its first layer (a DeltaNet one, which would move its
    states): a slot past the cache raises ValueError naming it, and every DeltaNet layer's conv and recurrent states
    are as they were."""
    import copy

    from novainfer import LLM, SamplingParams
    from novainfer.attention.metadata import attention_metadata, get_attention_metadata
    from novainfer.worker import cpu_hybrid_stack

    seen = []
    forward = cpu_hybrid_stack.CPUHybridStack.forward

    def keep(self, input_ids, positions):
        seen.append((self, get_attention_metadata(), input_ids.clone(), positions.clone()))
        return forward(self, input_ids, positions)

    monkeypatch.setattr(cpu_hybrid_stack.CPUHybridStack, "forward", keep)
    llm = LLM(files["q8_0"], max_model_len=256, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    stack, meta, ids, pos = seen[-1]
    bad = copy.copy(meta)
    bad.__dict__.pop("cpu_attn_operands", None)  # the step's converted operands, cached on it
    bad.slot_mapping = meta.slot_mapping.clone()
    bad.slot_mapping[0] = 1 << 40
    states = [
        t.clone()
        for layer in stack.layers
        if layer.is_linear
        for t in (layer.linear_attn.conv_state, layer.linear_attn.ssm_state)
    ]
    assert len(states) >= 2
    with torch.inference_mode(), attention_metadata(bad), pytest.raises(ValueError, match="KV slot 1099511627776"):
        stack.forward(ids, pos)
    after = [
        t
        for layer in stack.layers
        if layer.is_linear
        for t in (layer.linear_attn.conv_state, layer.linear_attn.ssm_state)
    ]
    assert all(torch.equal(a, b) for a, b in zip(states, after))

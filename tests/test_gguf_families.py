"""GGUF files of every family made by llama.cpp's own converter from the tiny random HF checkpoints of
tests/tiny_models.py: Mistral and Mixtral (written as `llama`), Gemma 2, Gemma 3, Phi-3 (fused qkv / gate_up, LongRoPE
factors as tensors), Qwen2-MoE (shared expert and its gate), Qwen3-MoE (stacked `*_exps` experts) and Gemma 4
(`gemma4`: per-layer embeddings, KV-shared layers, k_eq_v full layers; and the MoE variant).

  * the f32 file gives transformers' greedy tokens on the HF folder, with the tokenizer and chat template read from
    the file;
  * llama.cpp (llama-cpp-python) on the same f32 file agrees with NovaInfer's logits in >= 99% of top-1 tokens;
  * the Q8_0 file, kept quantized, agrees with the float32 reference on its own dequantized weights in >= 99% of
    teacher-forced top-1 tokens and is no further from it in KL than llama.cpp is on the same file;
  * the F16 file's matrices (embeddings and output heads too) stay 16-bit, multiplied as stored, and give the
    logits its float32 copies gave to float32 summation order;
  * with the one-GPU GGUF config, Gemma 4's Q8_0 experts stay blocks (its gate_up stack split per expert).

The configs keep to what a GGUF records and llama.cpp runs: Gemma 2's query_pre_attn_scalar is its head_dim, Gemma 3
has six layers (llama.cpp's 5:1 sliding pattern), Phi-3's window is longer than the prompts (llama.cpp ignores
it), Qwen2-MoE has no dense-MLP layers, Mistral has no window (the converter drops it). Gemma 4 is
tests/test_gemma4.py's checkpoint at hidden size 128: at 32, Q8_0's rounding moves 5% of its near-tied top-1 tokens
(llama.cpp's run 18%).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.gguf_checkpoint import convert_hf_to_ggufs, llama_cpp_converter
from tests.test_model_families import one_thread  # noqa: F401  (autouse: one intra-op thread, as there)
from tests.test_gemma4 import save_tiny
from tests.tiny_models import hf_greedy, make_tiny_model

FAMILIES = {  # tiny_models family -> (config overrides, layers, extra tokens)
    "mistral": (dict(sliding_window=None), 2, ()),
    "mixtral": ({}, 2, ()),
    "gemma2": (dict(query_pre_attn_scalar=16), 2, ()),
    "gemma3": (dict(layer_types=["sliding_attention"] * 5 + ["full_attention"]), 6, ()),
    "phi3": (dict(sliding_window=200), 2, ("<s>", "</s>", "<unk>")),  # llama.cpp's phi3 vocabulary wants these
    "qwen2_moe": (dict(mlp_only_layers=[]), 2, ()),
    "qwen3_moe": ({}, 2, ()),
}
GEMMA4 = {"gemma4": False, "gemma4_moe": True}  # tests/test_gemma4.py's tiny checkpoints (MoE or not), wider:
GEMMA4_SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32, global_head_dim=64, moe_intermediate_size=64)
ALL = sorted(FAMILIES) + sorted(GEMMA4)
PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """family -> {"hf", "f32", "q8_0", "f16"} paths, built on first use."""
    if llama_cpp_converter() is None:
        pytest.skip("llama.cpp's converter (llama-cpp-python sdist) could not be fetched")
    files: dict[str, dict[str, str]] = {}

    def build(family: str) -> dict[str, str]:
        if family not in files:
            root = tmp_path_factory.mktemp(family)
            if family in GEMMA4:
                hf = save_tiny(str(root / "hf"), GEMMA4[family], **GEMMA4_SHAPE)
            else:
                overrides, layers, extra = FAMILIES[family]
                hf = make_tiny_model(
                    str(root / "hf"), family, seed=17, layers=layers, extra_tokens=extra, overrides=overrides
                )
            kinds = ("f32", "q8_0", "f16")
            outs = convert_hf_to_ggufs(hf, {kind: str(root / f"{kind}.gguf") for kind in kinds}, no_mtp=False)
            files[family] = {"hf": hf, **outs}
        return files[family]

    return build


def chunks(n: int = 2, length: int = 64) -> list[list[int]]:
    """Teacher-forced token ids. The tiny random MoE models have near-tied routes that a 1e-6 difference in the
    sums flips (then every later position of the chunk differs a little): with seed 0, llama.cpp's f32 run of
    Qwen2-MoE flips one route and NovaInfer's Q8_0 run of Mistral one top-1 token. Seed 1 has no such tie."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 390, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("family", ALL)
def test_f32_gguf_greedy_equals_transformers_on_the_hf_folder_with_the_files_tokenizer(family, family_files):
    from transformers import AutoTokenizer

    from novainfer import LLM, SamplingParams

    files = family_files(family)
    hf_tok = AutoTokenizer.from_pretrained(files["hf"])
    llm = LLM(files["f32"], dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=16)
    tok = llm.get_tokenizer()  # the tokenizer and chat template come from the file
    ids = tok.encode(PROMPT)
    assert ids == hf_tok.encode(PROMPT)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == hf_tok.apply_chat_template(messages, tokenize=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.shutdown()
    assert list(got) == hf_greedy(files["hf"], ids, 16)


@pytest.mark.parametrize("family", ALL)
def test_llamacpp_agrees_on_the_f32_file(family, family_files):
    pytest.importorskip("llama_cpp")
    from benchmarks.quant_accuracy import kl_and_top1, llamacpp_logits, novainfer_logits

    path = family_files(family)["f32"]
    ids = chunks()
    kl, top1 = kl_and_top1(novainfer_logits(path, ids, quantized=False), llamacpp_logits(path, ids, 1))
    assert top1 >= 0.99, (kl, top1)


@pytest.mark.parametrize("family", ALL)
def test_q8_0_file_kept_quantized_agrees_with_its_float32_reference(family, family_files):
    from benchmarks.quant_accuracy import against_float32_reference

    (kl, top1), llama = against_float32_reference(family_files(family)["q8_0"], chunks())
    assert top1 >= 0.99, (kl, top1)
    assert llama is None or kl <= llama[0], (kl, top1, llama)


@pytest.mark.parametrize("family", ALL)
def test_f16_file_multiplies_its_matrices_as_stored(family, family_files, monkeypatch):
    """Every F16 matrix of a kept-quantized layer (the embedding and the head among them) is packed as `f16`, and
    the logits equal those of the same path with the F16 tensors dequantized to float32 (the loader's way before
    the f16 kind), to float32 summation order: the same bfloat16 cache, only the GEMM differs."""
    from gguf import GGMLQuantizationType as T

    from benchmarks.quant_accuracy import kl_and_top1, novainfer_logits
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig, GGUFCPULinearMethod
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = family_files(family)["f16"]
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    kinds = {
        name: None if m.weight.packed is None else m.weight.packed.kind
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), GGUFCPULinearMethod)
    }
    assert kinds["model.embed_tokens"] == "f16" and kinds["model.layers.0.self_attn.o_proj"] == "f16", kinds
    assert set(kinds.values()) <= {"f16", None}, kinds  # None: the routers, which the converter writes F32
    ids = chunks()
    kept = novainfer_logits(path, ids, quantized=True)
    monkeypatch.setattr(GGUFCPULinearMethod, "TYPES", GGUFCPULinearMethod.TYPES - {T.F16})
    dense = novainfer_logits(path, ids, quantized=True)
    kl, top1 = kl_and_top1(dense, kept)
    assert top1 >= 0.99 and kl < 1e-6, (kl, top1)


@pytest.mark.parametrize("family", ["phi3", "qwen2_moe"])
def test_fused_and_shared_weights_stay_quantized_experts_load_dense(family, family_files):
    """Phi-3's fused qkv / gate_up rows split into quantized shards; Qwen2-MoE's attention and shared expert stay
    quantized while its expert stacks load dequantized (the fused MoE layer has no quantized kernel)."""
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = family_files(family)["q8_0"]
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    dense = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    layer, ref = model.model.layers[0], dense.model.layers[0]
    quantized = [(layer.self_attn.qkv_proj, ref.self_attn.qkv_proj)]
    if family == "phi3":
        quantized.append((layer.mlp.gate_up_proj, ref.mlp.gate_up_proj))
    else:
        quantized.append((layer.mlp.shared_expert.gate_up_proj, ref.mlp.shared_expert.gate_up_proj))
        assert torch.equal(layer.mlp.experts.w13_weight, ref.mlp.experts.w13_weight)
    for proj, want in quantized:
        assert proj.weight.packed is not None
        assert torch.allclose(proj.weight.packed.dequantize(), want.weight, atol=1e-6)


def test_gemma4_moe_experts_stay_quantized_with_the_gpu_config(family_files):
    """Gemma 4's fused gate_up stack splits into each expert's gate rows, then up rows, of blocks: the one-GPU GGUF
    config keeps its Q8_0 experts as blocks, GELU-tanh between the products (tests/test_gguf_moe_gpu.py's check)."""
    from tests.test_gguf_moe_gpu import check_experts_kept

    check_experts_kept(family_files("gemma4_moe")["q8_0"], lambda layer: layer.experts)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_unknown_family_metadata_is_refused(family, family_files, monkeypatch):
    from novainfer.loader import gguf_loader

    path = family_files(family)["f32"]
    monkeypatch.setitem(gguf_loader._reader(path).metadata, f"{family}.attention.scale", 0.5)
    with pytest.raises(NotImplementedError, match=f"{family}.attention.scale"):
        gguf_loader.load_gguf_config(path)


def test_files_name_their_families(family_files):
    """Mistral and Mixtral are `llama` files; the reader tells them apart by the experts."""
    from novainfer.loader.gguf_loader import load_gguf_config

    archs = {f: load_gguf_config(family_files(f)["f32"]).architectures[0] for f in ("mistral", "mixtral")}
    assert archs == {"mistral": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
    assert os.path.getsize(family_files("mixtral")["q8_0"]) < os.path.getsize(family_files("mixtral")["f32"])

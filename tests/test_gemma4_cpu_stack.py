"""Gemma 4's C decode stack (worker/cpu_gemma4_stack.py) against the layer-by-layer quantized CPU path it replaces,
on tests/test_gemma4.py's tiny dense checkpoint (per-layer inputs, KV-shared layers with double-wide MLPs, k = v full
layers with their own head size, a window shorter than the prompts: a grouped KV layout) converted to Q8_0 by
llama.cpp's converter: greedy tokens and their logprobs are equal to the bit with the stack on or off, over a batch
and each prompt alone, and the stack takes the decode steps. The same checkpoint converted to F16 (every matrix,
per_layer_model_proj included, kept as stored: kernels/cpu/repack.py's f16 kind) too, and it gives the greedy tokens
it gave when its F16 tensors loaded dequantized to float32."""

from __future__ import annotations

import os

import pytest

from benchmarks.gguf_checkpoint import convert_hf_to_ggufs, llama_cpp_converter
from novainfer import LLM, SamplingParams
from novainfer.kernels.cpu import library
from novainfer.worker import cpu_gemma4_stack
from tests.test_gemma4 import PROMPTS, save_tiny
from tests.test_model_families import one_thread  # noqa: F401  (autouse: one intra-op thread, as there)

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
# Q8_0 blocks of 32 along every matrix's input (the per-layer input size too)
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32, global_head_dim=64, hidden_size_per_layer_input=32)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    if llama_cpp_converter() is None:
        pytest.skip("llama.cpp's converter (llama-cpp-python sdist) could not be fetched")
    return save_tiny(str(tmp_path_factory.mktemp("gemma4_stack") / "hf"), moe=False, **SHAPE)


@pytest.fixture(scope="module")
def converted(tiny_hf) -> dict[str, str]:
    """The checkpoint converted by llama.cpp's converter to q8_0 and f16 (one converter process)."""
    outs = {kind: os.path.join(os.path.dirname(tiny_hf), f"{kind}.gguf") for kind in ("q8_0", "f16")}
    return convert_hf_to_ggufs(tiny_hf, outs, no_mtp=False)


@pytest.fixture(scope="module", params=["q8_0", "f16"])
def gguf_file(request, converted) -> str:
    return converted[request.param]


def run(path: str) -> list[list[tuple[list[int], list[float]]]]:
    """Greedy tokens and logprobs: the batch, then each prompt alone."""
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)
    got = []
    for prompts in [PROMPTS] + [[p] for p in PROMPTS]:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        got.append(
            [
                (
                    o.outputs[0].token_ids,
                    [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                )
                for o in outs
            ]
        )
    llm.llm_engine.shutdown()
    return got


def test_decode_steps_equal_the_layer_path_to_the_bit(gguf_file, monkeypatch):
    taken = []
    forward = cpu_gemma4_stack.CPUGemma4Stack.forward

    def counting(self, input_ids, positions):
        out = forward(self, input_ids, positions)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(cpu_gemma4_stack.CPUGemma4Stack, "forward", counting)
    on = run(gguf_file)
    assert sum(taken) >= 4 * (GREEDY.max_tokens - 1), taken  # every decode step of the four runs
    monkeypatch.setattr(cpu_gemma4_stack, "supports", lambda model: False)
    taken.clear()
    off = run(gguf_file)
    assert not taken
    assert on == off


def test_f16_weights_kept_as_stored_give_the_tokens_of_their_float32_copies(converted, monkeypatch):
    import torch
    from gguf import GGMLQuantizationType as T

    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig, GGUFCPULinearMethod
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = converted["f16"]
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    assert model.model.per_layer_model_projection.weight.packed.kind == "f16"
    assert model.model.embed_tokens.weight.packed.kind == "f16"  # the embedding (tied head) rows too
    kept = run(path)
    monkeypatch.setattr(GGUFCPULinearMethod, "TYPES", GGUFCPULinearMethod.TYPES - {T.F16})  # as before: dense
    dense = run(path)
    assert [[t for t, _ in group] for group in kept] == [[t for t, _ in group] for group in dense]


def test_gemma_ops_against_torch():
    """The C GELU-tanh gate (strided halves and rows, as the fused gate/up and the per-layer input slices) is
    torch's to float rounding; norm + residual is add_rms_norm's norm plus torch's sum, to the bit."""
    import torch
    import torch.nn.functional as F

    from novainfer.kernels.cpu import ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2 * 44, generator=g) * 3
    got = ops.gelu_tanh_mul(x[:, :44], x[:, 44:])  # 44: the vector loop and its scalar tail
    want = F.gelu(x[:, :44], approximate="tanh") * x[:, 44:]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    ple = torch.randn(5, 3, 44, generator=g)
    assert torch.allclose(
        ops.gelu_tanh_mul(x[:, :44], ple[:, 1]), F.gelu(x[:, :44], approximate="tanh") * ple[:, 1], 1e-5, 1e-6
    )
    h, w, res = torch.randn(5, 44, generator=g), torch.rand(44, generator=g) + 0.5, torch.randn(5, 44, generator=g)
    assert torch.equal(ops.rms_norm_add(h, w, 1e-6, res), res + ops.add_rms_norm(h, None, w, 1e-6)[0])

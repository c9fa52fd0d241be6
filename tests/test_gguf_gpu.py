"""GGUF weights kept quantized on the GPU, on the CPU through Triton's interpreter (conftest sets TRITON_INTERPRET):
the repacked layout dequantizes to gguf's own values, the GEMV and GEMM of every type equal x @ W^T, a fused layer
of mixed types and an embedding lookup work, and a tiny Q4_K_M file loaded with the GPU method gives the greedy
tokens of the dequantized path."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from benchmarks.gguf_checkpoint import SHAPES, write_qwen2_q4_k_m
from novainfer.kernels import gguf_gemm as gguf_gemm_module
from novainfer.kernels.cpu.repack import BLOCK
from novainfer.kernels.gguf_gemm import (
    GGUFWeight,
    dequantize,
    gguf_gemm,
    gguf_gemv,
    gguf_matmul,
    quantize_q8,
    quantize_q8_reference,
)
from novainfer.layers.quantization import gguf_gpu_layout
from novainfer.layers.quantization.gguf_gpu import GGUFGPUConfig
from novainfer.layers.quantization.gguf_gpu_layout import gpu_layout
from tests.test_quantized_cpu import random_blocks

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
CPU = torch.device("cpu")


def weight(qtype: T, n: int, k: int, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """A random [n, k] weight in the GPU layout and gguf's float32 dequantization of its blocks."""
    blocks = random_blocks(qtype, n, k, np.random.default_rng(seed))
    ref = torch.from_numpy(np.asarray(gguf_dequantize(blocks, qtype), np.float32).reshape(n, k))
    return gpu_layout(blocks, qtype, (n, k), CPU), ref


def x_hat(x: torch.Tensor) -> torch.Tensor:
    """The one row x [1, K] as the int8 GEMV multiplies it: its int8 values times their scales (quantize_q8_reference,
    which quantize_q8 must equal)."""
    xq, dx, sx = quantize_q8_reference(x)
    got = quantize_q8(x)
    assert torch.equal(got[0], xq) and torch.equal(got[1], dx) and torch.equal(got[2], sx)
    assert torch.equal(sx, (xq.float().view(-1, 16).sum(1) * dx.repeat_interleave(2)))
    return (xq.float().view(-1, 32) * dx[:, None]).view(1, -1)


def close(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> bool:
    want = x.double() @ ref.double().T
    return bool((y.double() - want).norm() <= 1e-5 * want.norm())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layout_is_exact_and_kernels_equal_the_reference(qtype, monkeypatch):
    n, k = 37, 768  # odd rows (a partial row tile), three super-blocks (a masked GEMV tail with BLOCK_K 512)
    w, ref = weight(qtype, n, k, int(qtype))
    assert torch.equal(dequantize(w), ref)  # the repack loses nothing: the same float32 products as gguf's
    per, nbytes = BLOCK[qtype]
    assert w.nbytes() <= 1.03 * (n * k // per * nbytes)  # about the file's bytes (Q4_K / Q5_K: 2 bytes a 256 more)
    monkeypatch.setattr(gguf_gpu_layout, "CHUNK_BYTES", 1)  # one row a chunk: the same layout
    assert torch.equal(dequantize(weight(qtype, n, k, int(qtype))[0]), ref)
    g = torch.Generator().manual_seed(0)
    for m, tiles in ((1, None), (1, (4, 512, 4)), (5, (4, 512, 4))):  # one row: int8 x and integer dot products
        x = torch.randn(m, k, generator=g)
        y = gguf_gemv(x, w, tiles=tiles)
        assert close(y, x_hat(x) if m == 1 else x, ref), (m, tiles)
        if m == 1:  # x's int8 rounding, as llama.cpp's MMVQ rounds it: about 1% of the product
            assert (y - x @ ref.T).norm() <= 3e-2 * (x @ ref.T).norm(), tiles
    x = torch.randn(19, k, generator=g)
    for split in (1, 2):
        assert close(gguf_gemm(x, w, split=split), x, ref), split
    # the Triton dequantize kernel: the same float32 products, bit for bit
    assert torch.equal(gguf_gemm_module.gguf_dequantize(w, torch.float32), ref)


def test_fused_layer_of_mixed_types_and_embedding_rows():
    k = 256
    parts = [weight(t, n, k, i) for i, (t, n) in enumerate([(T.Q4_K, 24), (T.Q4_K, 8), (T.Q6_K, 8)])]
    merged = [GGUFWeight.cat_rows([parts[0][0], parts[1][0]]), parts[2][0]]  # as the method stores q, k / v
    ref = torch.cat([r for _, r in parts])
    g = torch.Generator().manual_seed(1)
    for m in (1, 12):  # the GEMV (each part into its columns of one output), then the dequantized weight
        x = torch.randn(m, k, generator=g)
        assert close(gguf_matmul(x, merged), x_hat(x) if m == 1 else x, ref), m
    ids = torch.tensor([5, 0, 23, 5])
    assert torch.equal(dequantize(merged[0].select_rows(ids)), ref[ids])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_qwen2_q4_k_m(str(tmp_path_factory.mktemp("q4km-gpu") / "tiny-q4_k_m.gguf"), SHAPES["tiny"])


def test_model_layers_keep_blocks_and_equal_the_dequantized_linear(tiny_gguf):
    from novainfer.loader.model_loader import load_hf_config, load_model

    config = load_hf_config(tiny_gguf)
    quant = load_model(tiny_gguf, config, torch.float32, CPU, quant_config=GGUFGPUConfig())
    dense = load_model(tiny_gguf, config, torch.float32, CPU)
    layer1 = quant.model.layers[1]  # Q6_K attn_v beside Q4_K q / k: two parts
    assert [p.qtype for p in layer1.self_attn.qkv_proj.weight.packed] == ["Q4_K", "Q6_K"]
    assert [p.qtype for p in quant.lm_head.weight.packed] == ["Q6_K"]
    assert sum(p.numel() for p in quant.parameters()) < 10_000  # norms and biases: no dense copy of a weight
    g = torch.Generator().manual_seed(2)
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        q_lin, d_lin = layer1.get_submodule(name), dense.model.layers[1].get_submodule(name)
        x = torch.randn(9, q_lin.input_size, generator=g)  # the GEMM (the interpreter runs fewer programs)
        assert close(gguf_matmul(x, q_lin.weight.packed), x, d_lin.weight), name
    ids = torch.tensor([[3, 2047, 3]])
    assert torch.equal(quant.model.embed_tokens(ids), dense.model.embed_tokens(ids))


def test_greedy_tokens_equal_the_dequantized_path(tiny_gguf, monkeypatch):
    from novainfer import LLM, SamplingParams
    from novainfer.worker import model_runner

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 300, 7]}, {"prompt_token_ids": [42, 1500, 12]}]
    greedy = {}
    for mode in ("dequantized", "gguf-gpu"):
        if mode == "gguf-gpu":  # the GPU method on this CPU (its torch reference; the kernels are tested above)
            monkeypatch.setattr(model_runner, "get_quant_config", lambda *a, **k: GGUFGPUConfig())
        llm = LLM(tiny_gguf, max_model_len=128, dtype="float32", quantization="none", device="cpu")
        model = llm.llm_engine.executor.workers[0].model_runner.model
        assert (getattr(model.lm_head.weight, "packed", None) is not None) == (mode == "gguf-gpu")
        greedy[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
    assert greedy["gguf-gpu"] == greedy["dequantized"]


def test_selector_picks_the_gpu_method_on_cuda_only_on_one_rank(tiny_gguf):
    from novainfer.config import ModelConfig
    from novainfer.layers.quantization.selector import get_quant_config

    cuda = torch.device("cuda")
    assert isinstance(get_quant_config(ModelConfig(model=tiny_gguf), cuda), GGUFGPUConfig)
    assert get_quant_config(ModelConfig(model=tiny_gguf, quantization="none"), cuda) is None
    assert get_quant_config(ModelConfig(model=tiny_gguf, dtype="float32"), cuda) is None  # the exact path
    assert get_quant_config(ModelConfig(model=tiny_gguf), cuda, tp_size=2) is None


def test_kernels_compile_for_hopper_with_16_byte_quant_loads():
    """What the interpreter cannot show: every type's GEMV and split-K GEMM compile for sm_90
    (tests/gguf_sm90_ptx.py, in a process without the interpreter), the one-row GEMV reads the quants in 16-byte
    vectors and multiplies them by int8 x in dp4a instructions, the GEMM runs on wgmma with the dequantized weight as
    its register operand (out^T = W x^T) and adds its splits atomically."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tests", "gguf_sm90_ptx.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.splitlines()[-1])
    for qtype in TYPES:
        gemv, gemm = ptx[f"{qtype.name}_gemv"], ptx[f"{qtype.name}_gemm_split"]
        assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in gemv, qtype.name
        assert "dp4a." in gemv, qtype.name  # four quants times four int8 inputs an instruction
        assert "wgmma.mma_async" in gemm and ("red.global" in gemm or "atom.global" in gemm), qtype.name
        assert re.search(r"wgmma\.mma_async\S* \{[^}]*\}, \{%r", gemm), qtype.name  # A from registers


def test_batch_invariant_gguf_on_a_gpu_is_refused_naming_the_field(tiny_gguf):
    from novainfer.config import EngineConfig

    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig.from_kwargs(tiny_gguf, device="cuda", batch_invariant=True)
    EngineConfig.from_kwargs(tiny_gguf, device="cuda", batch_invariant=True, quantization="none")  # dequantized

"""GGUF MoE experts kept quantized on one GPU (layers/quantization/gguf_moe.py, kernels/fused_moe_gguf.py), on the CPU
through Triton's interpreter (conftest sets TRITON_INTERPRET): expert stacks of each GPU type (gate and up of one
type in one part, of two types in two, a dense down where a type has no kernel) through the few-token int8-x GEMV
and the grouped GEMMs equal the experts on gguf's own dequantization, and a tiny Qwen3-MoE GGUF loaded with the GPU
config keeps its experts in the repacked layout at about the file's bytes, its layers equal to the dequantized
model's (check_experts_kept: the same for the Qwen3.5-MoE and Gemma 4 files llama.cpp's converter makes, whose
readers split their own expert stacks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from novainfer.kernels.cpu.repack import BLOCK
from novainfer.kernels.fused_moe_gguf import fused_experts_gguf
from novainfer.layers.activation import get_act_and_mul
from novainfer.layers.fused_moe.moe_torch import fused_experts_torch
from novainfer.layers.quantization.gguf_cpu import GGUFQuantTensor
from novainfer.layers.quantization.gguf_gpu import GGUFGPUConfig
from novainfer.layers.fused_moe.gguf_torch import fused_experts_gguf_reference
from novainfer.layers.quantization.gguf_moe import stack_experts
from tests.test_quantized_cpu import random_blocks

CPU = torch.device("cpu")
E, TOP_K = 4, 2
ACT = get_act_and_mul("silu")


def shards(qtype: T, n: int, k: int, rng: np.random.Generator) -> tuple[list[GGUFQuantTensor], torch.Tensor]:
    """E experts' [n, k] blocks as the loader yields them, and gguf's float32 dequantization [E, n, k]."""
    blocks = [random_blocks(qtype, n, k, rng) for _ in range(E)]
    ref = [np.asarray(gguf_dequantize(b, qtype), np.float32).reshape(n, k) for b in blocks]
    return [GGUFQuantTensor("w", b, qtype, (n, k)) for b in blocks], torch.from_numpy(np.stack(ref))


# (gate, up, down, hidden, intermediate): Q4_K_M's mix; K-quants with 32-block downs; gate and up of two types (two
# parts); a down of a type without a kernel (dense: the bf16 kernels run that side)
CASES = [
    (T.Q4_K, T.Q4_K, T.Q6_K, 256, 256),
    (T.Q5_K, T.Q5_K, T.Q8_0, 256, 64),
    (T.Q8_0, T.Q4_0, T.Q4_1, 64, 96),
    (T.Q6_K, T.Q6_K, None, 256, 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(t.name if t else "dense" for t in c[:3]))
def test_expert_kernels_equal_the_experts_on_ggufs_dequantization(case):
    gate, up, down, hidden, inter = case
    rng = np.random.default_rng(hidden + inter + int(gate))
    (s1, d1), (s3, d3) = shards(gate, inter, hidden, rng), shards(up, inter, hidden, rng)
    w13 = stack_experts([s1, s3], hidden, CPU)
    assert [p.qtype for p in w13] == ([gate.name] if gate == up else [gate.name, up.name])
    assert w13[0].qweight.shape[0] == E and w13[0].qweight.is_contiguous()
    d13 = torch.cat([d1, d3], dim=1)
    if down is None:
        d2 = torch.randn(E, hidden, inter, generator=torch.Generator().manual_seed(0)) * 0.05
        w2 = d2
    else:
        s2, d2 = shards(down, hidden, inter, rng)
        w2 = stack_experts([s2], inter, CPU)
    g = torch.Generator().manual_seed(inter)
    runs = [(3, None), (9, None)]  # the GEMV; the grouped GEMMs
    if gate == T.Q5_K:  # a sweep's tiles: many K steps, partial row tiles (once: the interpreter is slow)
        runs.append((9, (16, 32, 32, 4, 1)))
    for tokens, tiles in runs:
        x = torch.randn(tokens, hidden, generator=g)
        weights, ids = torch.softmax(torch.randn(tokens, E, generator=g), -1).topk(TOP_K, -1)
        want = fused_experts_torch(x, d13, d2, weights, ids, ACT)
        ref = fused_experts_gguf_reference(x, w13, w2, weights, ids, ACT)
        torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)  # the layout dequantizes to gguf's values
        got = fused_experts_gguf(x, w13, w2, weights, ids, ACT, tiles=tiles)
        if tokens <= 4 and tiles is None:  # x and the activation rounded to int8 per 32, as llama.cpp's MMVQ does
            rounded = fused_experts_gguf_reference(x, w13, w2, weights, ids, ACT, q8_activations=True)
            assert (got - rounded).norm() <= 1e-4 * rounded.norm(), (tokens, (got - rounded).norm() / rounded.norm())
            assert (got - want).norm() <= 3e-2 * want.norm()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# ---- a tiny Qwen3-MoE file -----------------------------------------------------------------------------------------
H, INTER, HEADS, HEAD_DIM, VOCAB = 256, 256, 2, 64, 64
# layer 1: gate and up in two parts, a dense down (Q5_0 has no GPU kernel: it arrives dequantized); layer 2: a dense
# gate/up side, its Q4_K gate dequantized beside the Q5_0 up
LAYER_EXPERTS = [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q4_0, T.Q5_0), (T.Q4_K, T.Q5_0, T.Q8_0)]


def write_qwen3_moe(path: str) -> str:
    """float32 attention, norms, router and embeddings; each layer's experts of LAYER_EXPERTS' types."""
    rng = np.random.default_rng(7)
    w = GGUFWriter(path, "qwen3moe")
    for key, value in dict(
        context_length=256,
        embedding_length=H,
        block_count=len(LAYER_EXPERTS),
        feed_forward_length=INTER,
        head_count=HEADS,
        head_count_kv=1,
        key_length=HEAD_DIM,
        value_length=HEAD_DIM,
        layer_norm_rms_eps=1e-6,
        rope_freq_base=1e6,
        expert_count=E,
        expert_used_count=TOP_K,
        expert_feed_forward_length=INTER,
        vocab_size=VOCAB,
    ).items():
        getattr(w, f"add_{key}")(value)
    f32 = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(VOCAB, H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", f32(VOCAB, H))
    for i, types in enumerate(LAYER_EXPERTS):
        p = f"blk.{i}."
        for name, shape in (
            ("attn_q", (HEADS * HEAD_DIM, H)),
            ("attn_k", (HEAD_DIM, H)),
            ("attn_v", (HEAD_DIM, H)),
            ("attn_output", (H, HEADS * HEAD_DIM)),
            ("ffn_gate_inp", (E, H)),
        ):
            w.add_tensor(p + name + ".weight", f32(*shape))
        for name, size in (("attn_norm", H), ("ffn_norm", H), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            w.add_tensor(p + name + ".weight", np.ones(size, np.float32))
        for name, qtype, (n, k) in zip(
            ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), types, ((INTER, H), (INTER, H), (H, INTER))
        ):
            blocks = np.stack([random_blocks(qtype, n, k, rng) for _ in range(E)])
            w.add_tensor(p + name + ".weight", blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen3_moe_file_keeps_its_experts_quantized(tmp_path):
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = write_qwen3_moe(str(tmp_path / "tiny-qwen3-moe.gguf"))
    config = load_hf_config(path)
    quant = load_model(path, config, torch.float32, CPU, quant_config=GGUFGPUConfig())
    dense = load_model(path, config, torch.float32, CPU)
    q0, q1, q2 = (layer.mlp.experts for layer in quant.model.layers)
    assert [p.qtype for p in q0.w13_weight.packed] == ["Q4_K"] and [p.qtype for p in q0.w2_weight.packed] == ["Q6_K"]
    assert [p.qtype for p in q1.w13_weight.packed] == ["Q8_0", "Q4_0"] and q1.w2_weight.packed is None
    file_bytes = sum(
        E * n * k // BLOCK[t][0] * BLOCK[t][1] for t, (n, k) in zip(LAYER_EXPERTS[0], ((INTER, H),) * 2 + ((H, INTER),))
    )
    held = sum(p.nbytes() for p in q0.w13_weight.packed + q0.w2_weight.packed)
    assert file_bytes <= held <= 1.03 * file_bytes  # about the file's size, not float (4 bytes a weight here)
    assert q0.w13_weight.numel() == 0 and q1.w2_weight.shape == (E, H, INTER)  # the Q5_0 down: dense
    g = torch.Generator().manual_seed(3)
    assert q2.w13_weight.packed is None and [p.qtype for p in q2.w2_weight.packed] == ["Q8_0"]
    assert torch.equal(q2.w13_weight.data, dense.model.layers[2].mlp.experts.w13_weight)  # gguf's values exactly
    for layer in range(len(LAYER_EXPERTS)):
        q, d = quant.model.layers[layer].mlp.experts, dense.model.layers[layer].mlp.experts
        x = torch.randn(5, H, generator=g)
        weights, ids = torch.softmax(torch.randn(5, E, generator=g), -1).topk(TOP_K, -1)
        want = d.apply_routed(x, weights, ids)
        torch.testing.assert_close(q.apply_routed(x, weights, ids), want, rtol=1e-5, atol=1e-6)  # the CPU reference
        w13, w2 = (p.packed or p.data for p in (q.w13_weight, q.w2_weight))
        got = fused_experts_gguf(x, w13, w2, weights, ids, ACT)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())  # the kernels


def check_experts_kept(path: str, experts_of) -> None:
    """A converter-made GGUF file whose *_exps stacks are Q8_0, loaded with the GPU config on the CPU device and
    dequantized: each MoE layer's experts (experts_of(decoder layer)) stay Q8_0 blocks, with no dense copy, together
    at about the file's expert bytes, and equal the dequantized layer's on random routes (the torch reference; the
    first layer through the interpreted kernels too, with the layer's own activation)."""
    from novainfer.loader.gguf_loader import _reader
    from novainfer.loader.model_loader import load_hf_config, load_model

    config = load_hf_config(path)
    quant = load_model(path, config, torch.float32, CPU, quant_config=GGUFGPUConfig())
    dense = load_model(path, config, torch.float32, CPU)
    stacks = [t for t in _reader(path).tensors if t.name.endswith("_exps.weight")]
    assert stacks and {t.tensor_type for t in stacks} == {T.Q8_0}
    held, g = 0, torch.Generator().manual_seed(0)
    for i, (q_layer, d_layer) in enumerate(zip(quant.model.layers, dense.model.layers)):
        q, d = experts_of(q_layer), experts_of(d_layer)
        assert [p.qtype for p in q.w13_weight.packed] == ["Q8_0"] and [p.qtype for p in q.w2_weight.packed] == ["Q8_0"]
        assert q.w13_weight.numel() == 0 and q.w2_weight.numel() == 0
        held += sum(p.nbytes() for p in q.w13_weight.packed + q.w2_weight.packed)
        x = torch.randn(5, q.w13_weight.full_shape[2], generator=g)
        weights, ids = torch.softmax(torch.randn(5, q.num_experts, generator=g), -1).topk(q.top_k, -1)
        want = d.apply_routed(x, weights, ids)
        torch.testing.assert_close(q.apply_routed(x, weights, ids), want, rtol=1e-5, atol=1e-6)
        if i == 0:
            got = fused_experts_gguf(x, q.w13_weight.packed, q.w2_weight.packed, weights, ids, q.act_fn)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    file_bytes = sum(t.nbytes for t in stacks)
    assert file_bytes <= held <= 1.03 * file_bytes  # about the file's size, not float (4 bytes a weight here)

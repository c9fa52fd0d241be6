"""GGUF weights kept quantized on the CPU: each format's kernel against dequantize-then-matmul, the default
model's greedy text alone and batched, its KL against the float32 dequantized reference, the fallback for a
type without a kernel, and clear errors for truncated or corrupt files."""

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from novainfer.kernels.cpu import library, qgemm
from novainfer.kernels.cpu.repack import BLOCK, merge_rows, repack

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
RNG = np.random.default_rng(0)
FORMATS = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
D_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # fp16 super-block scales, set to sane values


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator = RNG) -> np.ndarray:
    """GGUF blocks for an [n, k] weight: quantized by gguf where it can, else random bytes with sane scales.
    A file whose test bounds depend on its values passes its own rng (the shared one's state depends on which
    tests ran before)."""
    if qtype not in D_OFFSETS:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    per, nbytes = BLOCK[qtype]
    b = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for off in D_OFFSETS[qtype]:
        b[..., off : off + 2] = (
            np.float16(rng.uniform(1e-3, 1e-2, (n, k // per))).view(np.uint8).reshape(n, k // per, 2)
        )
    return b.reshape(n, -1)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(7, 256), (33, 512), (65, 768)])  # odd rows; several groups / super-blocks
def test_repack_is_exact_and_kernel_matches_dequantize_then_matmul(qtype, n, k):
    blocks = random_blocks(qtype, n, k, np.random.default_rng(n * k + int(qtype)))  # fixed: not order-dependent
    w = repack(blocks, qtype, (n, k))
    ref_w = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(w.dequantize(), ref_w)  # the repack keeps every value exactly
    torch.testing.assert_close(qgemm.dequantize(w), ref_w, rtol=1e-6, atol=1e-7)  # C: q * s + z fused
    for m in (1, 9, 17):  # batch 1, a partial row tile, more than two tiles
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1000 * m + k))
        ref = x.double() @ ref_w.double().T
        # x is rounded to int16 per block of 32 (step max|x| / 32767, error at most half a step), then summed in
        # float32 in another order than the reference: bounded by sum |w| step / 2 + k eps sum |x w|
        step = x.abs().view(m, k // 32, 32).amax(-1).double().repeat_interleave(32, dim=1) / 32767
        tol = (step / 2 * 1.001) @ ref_w.abs().double().T
        tol += 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ ref_w.abs().double().T)
        y = qgemm.quant_gemm(x, w)
        assert ((y.double() - ref).abs() <= tol + 1e-6).all()
        # and typically far inside it: over 900 random cases the relative error had median 2e-5, p99 7e-5, max 1.0e-4
        # (int8 activations would be ~250x that)
        assert (y.double() - ref).norm() < 3e-4 * ref.norm()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_embedding_lookup_equals_the_dequantized_rows(qtype):
    from novainfer.layers.quantization.gguf_cpu import GGUFCPULinearMethod

    blocks = random_blocks(qtype, 300, 256)
    layer = torch.nn.Module()
    method = GGUFCPULinearMethod()
    layer.weight = method.create_weights(layer, 300, 256)
    layer.weight.packed = repack(blocks, qtype, (300, 256))
    ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
    ref = torch.from_numpy(dequantize(blocks, qtype).reshape(300, 256).astype(np.float32))[ids]
    torch.testing.assert_close(method.embedding(layer, ids), ref, rtol=1e-6, atol=1e-7)


def test_kernel_gives_the_same_bits_on_one_thread_or_many():
    w = repack(random_blocks(T.Q4_1, 1000, 512), T.Q4_1, (1000, 512))
    x = torch.randn(5, 512)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qgemm.quant_gemm(x, w)
        torch.set_num_threads(2)
        assert torch.equal(qgemm.quant_gemm(x, w), one)  # each output row is summed by one thread
    finally:
        torch.set_num_threads(prev)


def test_mixed_types_merge_into_one_exact_layer():
    k = 256
    parts = [(T.Q4_K, 8), (T.Q6_K, 4), (T.Q8_0, 4)]  # a Q4_K_M file's q / v / other layouts fused into qkv
    blocks = [random_blocks(t, n, k) for t, n in parts]
    merged = merge_rows([repack(b, t, (n, k)) for b, (t, n) in zip(blocks, parts)])
    ref = np.concatenate([dequantize(b, t).reshape(n, k) for b, (t, n) in zip(blocks, parts)])
    assert merged.kind == "q8" and merged.group == 16
    assert torch.equal(merged.dequantize(), torch.from_numpy(ref.astype(np.float32)))
    torch.testing.assert_close(qgemm.dequantize(merged), merged.dequantize(), rtol=1e-6, atol=1e-7)
    x = torch.randn(3, k)  # the kernel on groups of 16 with zero points (the Q4_K part)
    want = x.double() @ torch.from_numpy(ref).double().T
    assert (qgemm.quant_gemm(x, merged).double() - want).norm() < 1e-4 * want.norm()


@pytest.fixture(scope="module")
def fast_llm():
    from novainfer import LLM

    return LLM(max_model_len=512, block_size=16)  # the defaults: quantized weights, bf16 KV, cpu attention


def test_defaults_keep_the_default_model_quantized():
    from novainfer.config import ModelConfig
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.layers.quantization.selector import get_quant_config
    from novainfer.loader.default_model import default_model_path
    from novainfer.loader.model_loader import load_hf_config, load_model

    path, cpu = default_model_path(), torch.device("cpu")
    assert get_quant_config(ModelConfig(model=path, dtype=torch.float32), cpu) is None  # the exact path
    assert get_quant_config(ModelConfig(model=path, quantization="none"), cpu) is None
    config = get_quant_config(ModelConfig(model=path), cpu)
    assert isinstance(config, GGUFCPUConfig)
    model = load_model(path, load_hf_config(path), torch.float32, cpu, quant_config=config)
    packed = {id(m.weight) for m in model.modules() if getattr(getattr(m, "weight", None), "packed", None) is not None}
    assert len(packed) == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the embedding tied to lm_head
    assert model.lm_head.weight.packed is model.model.embed_tokens.weight.packed
    assert sum(p.numel() for p in model.parameters()) < 1e6  # no dense copy of a quantized weight is kept


def test_greedy_text_same_alone_and_in_a_batch_of_8(fast_llm):
    from novainfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [
        "The capital of France is",
        "List three colours:",
        "Once upon a time",
        "def add(a, b):",
        "The sea is",
        "Water boils at",
        "My favourite book",
        "Translate 'cat' to French:",
    ]
    alone = fast_llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    batch = fast_llm.generate(prompts, params, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert "Paris" in fast_llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].text


def test_kl_to_float32_reference_is_small():
    from benchmarks.quant_accuracy import kl_and_top1, make_chunks, novainfer_logits
    from novainfer.loader.default_model import default_model_path

    path = default_model_path()
    chunks = make_chunks(path, 160, 160)
    ref = novainfer_logits(path, chunks, quantized=False)
    kl, top1 = kl_and_top1(ref, novainfer_logits(path, chunks, quantized=True))
    # the weights are exact; what differs is the bf16 KV cache and summation order (measured: ~1e-4)
    assert kl < 2e-3 and top1 > 0.95, (kl, top1)


# ---- bad input -------------------------------------------------------------------------------------
def write_tiny_gguf(path, types: dict[str, T]) -> None:
    """A 1-layer llama GGUF with random weights; `types` gives the tensor type per GGUF base name."""
    import gguf

    hidden, inter, vocab, heads = 64, 128, 96, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    shapes = {
        "token_embd": (vocab, hidden),
        "output_norm": (hidden,),
        "blk.0.attn_norm": (hidden,),
        "blk.0.ffn_norm": (hidden,),
        "blk.0.attn_q": (hidden, hidden),
        "blk.0.attn_k": (hidden, hidden),
        "blk.0.attn_v": (hidden, hidden),
        "blk.0.attn_output": (hidden, hidden),
        "blk.0.ffn_gate": (inter, hidden),
        "blk.0.ffn_up": (inter, hidden),
        "blk.0.ffn_down": (hidden, inter),
    }
    for name, shape in shapes.items():
        data = RNG.standard_normal(shape).astype(np.float32) * 0.1
        qtype = types.get(name, T.F32 if len(shape) == 1 else T.Q8_0)
        if qtype == T.F32:
            w.add_tensor(f"{name}.weight", data)
        else:
            w.add_tensor(f"{name}.weight", quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_logits(path, quantized: bool) -> torch.Tensor:
    from benchmarks.quant_accuracy import novainfer_logits

    return novainfer_logits(str(path), [[1, 5, 9, 3, 7]], quantized)


def test_unsupported_type_falls_back_to_dequantized_with_one_log_line(tmp_path, caplog):
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, {"blk.0.attn_v": T.Q5_0, "blk.0.ffn_up": T.Q5_0, "blk.0.ffn_down": T.Q4_1})
    with caplog.at_level(logging.INFO, logger="novainfer.loader.gguf_loader"):
        quant = tiny_logits(path, quantized=True)
    lines = [r.getMessage() for r in caplog.records if "Q5_0" in r.getMessage()]
    assert len(lines) == 1 and "dequantized" in lines[0]
    ref = tiny_logits(path, quantized=False)
    assert torch.allclose(quant, ref, atol=2e-2, rtol=0)  # the bf16 KV cache is the only difference


def test_truncated_gguf_names_the_file_and_tensor(tmp_path):
    from novainfer.loader import gguf_loader

    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, {})
    raw = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: len(raw) - 3000])
    with pytest.raises(ValueError, match=r"cut\.gguf is corrupt or truncated"):
        gguf_loader.load_gguf_config(str(cut))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(RNG.integers(0, 256, 200, dtype=np.uint8)))
    with pytest.raises(ValueError, match=r"junk\.gguf is corrupt or truncated"):
        gguf_loader.load_gguf_config(str(junk))

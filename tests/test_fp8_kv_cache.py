"""The fp8 (e4m3) KV cache: the Triton store, decode (one program and split contexts, with and without the fused
rotary store) and prefill kernels (TRITON_INTERPRET=1 on the CPU, conftest.py) against the torch reference on the
same fp8 cache (tight) and against full-precision K/V (loose); the config's names and refusals; and the engine's
greedy tokens with an fp8 cache against a float32 one on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from novainfer.attention import torch_backend
from novainfer.config import EngineConfig, resolve_cache_dtype
from novainfer.kernels.kv_fp8 import FP8_MAX, to_fp8
from tests.test_kernels import BLOCK_SIZE, make_case, rel_err

kernels = pytest.importorskip("novainfer.kernels.paged_attention")
from novainfer.kernels.kv_store import store_kv  # noqa: E402

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.03  # values up to ~4 sigma / scale stay in range; a few outliers are clamped


def fp8_case(seed: int, ctx: list[int], q_lens: list[int], nh: int, nkv: int):
    """make_case's float32 cache and its fp8 copy (stored by the torch reference with the scales)."""
    q, kc, vc, bt, qsl, sl, meta = make_case(seed, ctx, q_lens, nh, nkv)
    return q, kc, vc, to_fp8(kc, K_SCALE), to_fp8(vc, V_SCALE), bt, qsl, sl, meta


def test_store_kv_writes_scaled_e4m3_as_the_reference():
    """Strided rows, a padding slot, random values over e4m3's whole range (subnormals, ties, carries into the next
    power of two), values past +-448 * scale clamped: the values torch_backend's store writes (the kernel rounds
    on e4m3's grid itself, which Triton's interpreter's cast gets wrong: 31.9 -> 16)."""
    g = torch.Generator().manual_seed(1)
    kvh, hd, n = 2, 64, 40
    qkv = torch.randn(n, 4 * kvh * hd, generator=g) * torch.logspace(-4, 2, n)[:, None]
    key, value = qkv[:, : kvh * hd].view(n, kvh, hd), qkv[:, 2 * kvh * hd : 3 * kvh * hd].view(n, kvh, hd)
    key[0, 0, :4] = torch.tensor([31.9, 29.0, 100.0, 1e4]) * K_SCALE  # carry, two ties, clamp
    value[2, 1, 3] = -1e4  # far past the range: stored as -448
    slots = torch.randperm(12 * BLOCK_SIZE, generator=g)[:n]
    slots[1] = -1
    caches = [torch.zeros(12, BLOCK_SIZE, kvh, hd, dtype=FP8) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    torch_backend.store_kv(key, value, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[0].float(), caches[2].float()) and torch.equal(caches[1].float(), caches[3].float())
    k = caches[0].view(-1, kvh, hd)
    assert k[slots[0], 0, :4].float().tolist() == [32.0, 28.0, 96.0, FP8_MAX]
    assert caches[1].view(-1, kvh, hd)[slots[2], 1, 3].float() == -FP8_MAX
    unused = torch.ones(12 * BLOCK_SIZE, dtype=torch.bool)
    unused[slots[slots >= 0]] = False
    assert not k[unused].float().any()  # slot -1 wrote nothing


@pytest.mark.parametrize("num_splits,window", [(1, None), (4, None), (4, 9)])
def test_decode_reads_fp8_as_the_reference(num_splits, window):
    """GQA, contexts from 1 to 41 keys, split contexts merged, a window: the dequantized reference to float32
    rounding; float32 K/V within fp8's rounding."""
    ctx = [0, 3, 15, 40]
    q, kc, vc, k8, v8, bt, qsl, sl, meta = fp8_case(2, ctx, [1] * len(ctx), 6, 2)
    out = kernels.decode_attention(
        q, k8, v8, bt, sl, 0.25, num_splits=num_splits, min_split_keys=8, sliding_window=window,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    ref = torch_backend.paged_attention(q, k8, v8, meta, 0.25, window, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, torch_backend.paged_attention(q, kc, vc, meta, 0.25, window)) < 0.05


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_reads_fp8_as_the_reference(window):
    """Fresh prompts and chunks after a cached prefix, GQA."""
    ctx, qlen = [0, 8, 5], [7, 5, 21]
    q, kc, vc, k8, v8, bt, qsl, sl, meta = fp8_case(3, ctx, qlen, 4, 2)
    out = kernels.prefill_attention(
        q, k8, v8, bt, qsl, sl, max(qlen), 0.3, sliding_window=window, k_scale=K_SCALE, v_scale=V_SCALE
    )
    ref = torch_backend.paged_attention(q, k8, v8, meta, 0.3, window, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, torch_backend.paged_attention(q, kc, vc, meta, 0.3, window)) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_queries_over_fp8_take_float16_products_scaled_per_row(dtype):
    """A bf16 / fp16 query over an fp8 cache is divided by its row's largest |q| and multiplied in float16 (e4m3
    widens to it in one instruction): queries past float16's 65504 neither overflow nor lose the reference's
    result; decode (one and four splits) and prefill, to the output dtype's rounding."""
    ctx = [0, 3, 15, 40]
    q, kc, vc, k8, v8, bt, qsl, sl, meta = fp8_case(4, ctx, [1] * len(ctx), 6, 2)
    q = (q * torch.logspace(-3, 5 if dtype == torch.bfloat16 else 4, 16)).to(dtype)  # elements 1e-3 .. 1e5
    sm = 0.25 / q.float().abs().amax().item()
    ref = torch_backend.paged_attention(q.float(), k8, v8, meta, sm, k_scale=K_SCALE, v_scale=V_SCALE)
    for splits in (1, 4):
        out = kernels.decode_attention(
            q, k8, v8, bt, sl, sm, num_splits=splits, min_split_keys=8, k_scale=K_SCALE, v_scale=V_SCALE
        )
        assert out.dtype == dtype and rel_err(out.float(), ref) < 1e-2
    ctx, qlen = [0, 8, 5], [7, 5, 21]
    q, kc, vc, k8, v8, bt, qsl, sl, meta = fp8_case(5, ctx, qlen, 4, 2)
    q = (q * 1e5).to(dtype) if dtype == torch.bfloat16 else q.to(dtype)
    ref = torch_backend.paged_attention(
        q.float(), k8, v8, meta, 0.3 / q.float().abs().amax().item(), k_scale=K_SCALE, v_scale=V_SCALE
    )
    out = kernels.prefill_attention(
        q, k8, v8, bt, qsl, sl, max(qlen), 0.3 / q.float().abs().amax().item(), k_scale=K_SCALE, v_scale=V_SCALE
    )
    assert out.dtype == dtype and rel_err(out.float(), ref) < 1e-2


def test_scales_are_ignored_by_a_full_precision_cache():
    """A bf16/fp32 cache stores and reads values as they are, whatever the layer's scales (as vLLM does)."""
    q, kc, vc, bt, qsl, sl, meta = make_case(4, [6, 11], [1, 1], 4, 2)
    plain = kernels.decode_attention(q, kc, vc, bt, sl, 0.25)
    assert torch.equal(kernels.decode_attention(q, kc, vc, bt, sl, 0.25, k_scale=0.5, v_scale=0.5), plain)
    assert torch.equal(torch_backend.paged_attention(q, kc, vc, meta, 0.25, k_scale=0.5, v_scale=0.5),
                       torch_backend.paged_attention(q, kc, vc, meta, 0.25))  # fmt: skip


def test_decode_with_rope_stores_fp8_as_store_kv_does():
    """The batch-1 stack's decode kernel rotates the new key and stores it and its value itself: the same fp8
    cache bits and output as the rotary kernel, store_kv and plain decode one after the other."""
    from types import SimpleNamespace

    from novainfer.kernels import fused_ops
    from novainfer.layers.rotary import RotaryEmbedding

    ctx = [5, 30]
    q, kc, vc, k8, v8, bt, qsl, sl, meta = fp8_case(5, ctx, [1, 1], 6, 2)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, (6 + 2 * 2) * 16, generator=g)
    q, k, v = qkv[:, :96].view(2, 6, 16), qkv[:, 96:128].view(2, 2, 16), qkv[:, 128:].view(2, 2, 16)
    positions = sl.long() - 1
    slots = torch.tensor([bt[i, c // BLOCK_SIZE].item() * BLOCK_SIZE + c % BLOCK_SIZE for i, c in enumerate(ctx)])
    rope = RotaryEmbedding(16, 64, SimpleNamespace(rope_theta=10000.0))
    rq, rk = fused_ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache)
    k8b, v8b = k8.clone(), v8.clone()
    store_kv(rk, v, k8, v8, slots, K_SCALE, V_SCALE)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    ref = kernels.decode_attention(rq, k8, v8, bt, sl, 0.25, num_splits=2, min_split_keys=16, **scales)
    rope_args = kernels.DecodeRope(positions, rope.cos_cache, rope.sin_cache, k, v, slots)
    out = kernels.decode_attention(q, k8b, v8b, bt, sl, 0.25, num_splits=2, min_split_keys=16, rope=rope_args, **scales)
    assert torch.equal(k8b.view(torch.uint8), k8.view(torch.uint8)) and torch.equal(
        v8b.view(torch.uint8), v8.view(torch.uint8)
    )
    assert rel_err(out, ref) < 1e-6


# ---- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_vllm_keyword_and_names(name):
    """LLM(model, kv_cache_dtype=...) as vLLM spells it (the field is cache_dtype, --kv-cache-dtype on the CLI)."""
    cfg = EngineConfig.from_kwargs("m", kv_cache_dtype=name, attention_backend="triton")
    assert cfg.cache_config.cache_dtype == name
    assert resolve_cache_dtype(cfg, torch.float32, torch.device("cpu")) == FP8
    assert EngineConfig.from_kwargs("m", cache_dtype=name).cache_config.cache_dtype == name


def test_bad_names_and_backends_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs("m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(TypeError, match="given twice"):
        EngineConfig.from_kwargs("m", kv_cache_dtype="fp8", cache_dtype="auto")
    for backend in ("auto", "cpu"):  # the CPU's attention kernels read bf16/fp32 caches only
        cfg = EngineConfig.from_kwargs("m", kv_cache_dtype="fp8", attention_backend=backend)
        with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs the Triton attention backend"):
            resolve_cache_dtype(cfg, torch.float32, torch.device("cpu"))
    cfg = EngineConfig.from_kwargs("m", kv_cache_dtype="fp8", attention_backend="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_cache_dtype(cfg, torch.bfloat16, torch.device("cuda"))


def test_fp8_cache_is_refused_on_gpus_before_sm89(monkeypatch):
    """Triton's e4m3 conversions need Ada/Hopper: an A100 is told so at start-up."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cfg = EngineConfig.from_kwargs("m", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs .* 8.9 or newer; this is sm_80"):
        resolve_cache_dtype(cfg, torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_cache_dtype(cfg, torch.bfloat16, torch.device("cuda")) == FP8


def test_fp8_block_takes_half_the_bytes_of_bf16():
    """Capacity doubles: the GPU's block count is its memory budget over these bytes."""
    from types import SimpleNamespace

    from novainfer.worker.kv_cache import kv_bytes_per_block

    layers = [SimpleNamespace(kv_source=None, num_kv_heads=4, head_dim=128)] * 3
    assert kv_bytes_per_block(layers, 16, torch.bfloat16) == 2 * kv_bytes_per_block(layers, 16, FP8)


# ---- the engine ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_greedy_tokens_with_fp8_cache_match_fp32_cache(tiny_qwen2, backend):
    """A tiny random Qwen2 (near-flat logits, so the hardest case for agreement): the fp8 cache's greedy
    continuation against the float32 cache's, and each position of that continuation teacher-forced (the top-1
    of prompt logprobs) through both."""
    from novainfer import LLM, SamplingParams

    prompts = ["Hello", "The quick brown fox jumps over the lazy dog"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny_qwen2, dtype="float32", attention_backend=backend, block_size=4, enforce_eager=True,
                  kv_cache_dtype=kv)  # fmt: skip
        runner = llm.llm_engine.executor.workers[0].model_runner
        assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else torch.float32)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        runs[kv] = (llm, [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs])
    ref_llm, ref_seqs = runs["auto"]
    fp8_llm, fp8_seqs = runs["fp8"]
    gen = [(a[-12:], b[-12:]) for a, b in zip(ref_seqs, fp8_seqs)]
    free_agree = sum(x == y for a, b in gen for x, y in zip(a, b)) / sum(len(a) for a, _ in gen)
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    agree = total = 0
    for seq in ref_seqs:
        tops = []
        for llm in (ref_llm, fp8_llm):
            out = llm.generate([{"prompt_token_ids": seq}], forced, use_tqdm=False)[0]
            tops.append([next(t for t, lp in d.items() if lp.rank == 1) for d in out.prompt_logprobs[1:]])
        n = len(seq) - 12  # the float32 cache's own greedy tokens are its teacher-forced top-1
        assert tops[0][n - 1 :] == seq[n:]
        agree += sum(a == b for a, b in zip(tops[0], tops[1]))
        total += len(seq) - 1
    print(f"{backend}: fp8 vs fp32 KV greedy agreement {free_agree:.3f}, teacher-forced top-1 {agree / total:.3f}")
    assert agree / total >= 0.95


def test_checkpoint_kv_scales_reach_the_attention_layers(tiny_qwen2, tmp_path):
    """vLLM's `self_attn.k_scale`/`v_scale` (and the older `kv_scale`) in a checkpoint set the layers' scales; the
    fp8 cache then stores K/V divided by them; a scale with more than one value is refused naming it."""
    import shutil

    from safetensors.torch import save_file

    from novainfer import LLM, SamplingParams

    path = shutil.copytree(tiny_qwen2, tmp_path / "scaled")
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.125),
        "model.layers.1.self_attn.kv_scale": torch.tensor([0.5]),
    }
    save_file(scales, str(path / "kv_scales.safetensors"))
    llm = LLM(str(path), dtype="float32", attention_backend="torch", block_size=4, kv_cache_dtype="fp8")
    runner = llm.llm_engine.executor.workers[0].model_runner
    layers = runner.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.25, 0.125), (0.5, 0.5)]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    ref_llm = LLM(tiny_qwen2, dtype="float32", attention_backend="torch", block_size=4, kv_cache_dtype="fp8")
    ref_llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    ref = ref_llm.llm_engine.executor.workers[0].model_runner.attention_layers()[0]
    # the same K rows (the first block), stored at scale 1 and at 0.25: four times the values, within e4m3 rounding
    block = next(i for i in range(ref.k_cache.shape[0]) if layers[0].k_cache[i].float().abs().sum() > 0)
    assert torch.allclose(layers[0].k_cache[block].float() * 0.25, ref.k_cache[block].float(), rtol=0.13, atol=1e-2)
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2)}, str(path / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale"):
        LLM(str(path), dtype="float32", attention_backend="torch", kv_cache_dtype="fp8")

"""The fp8 group of tests/gpu/gpu_check.py (quantization="fp8", layers/quantization/fp8.py). Each function takes
its device, so tests/test_gpu_check_cpu.py runs the same code on tiny shapes on the CPU.

1. The fp8 linear method on Qwen2.5-7B's layer shapes (qkv with its bias, o_proj, gate_up, down) in bf16 against
   a float64 product of its dequantized operands (rel err <= 1e-2 with exact accumulation: bf16 output rounding;
   <= 2e-2 as configured, with Hopper's fast accumulation) and against the bf16 linear (<= 6e-2: fp8 keeps 3
   mantissa bits); on CUDA, its Triton per-token quantization against the torch
   ops (equal scales, float8 bytes equal but for at most 1e-4 of them).
2. A checkpoint's prompt logits (a batch, teacher-forced) with fp8 against the same checkpoint in bf16: relative
   error and top-1 agreement.
(The CUDA-graph replay of an fp8 model against eager is gpu_check.graph_vs_eager(quantization="fp8").)
"""

from __future__ import annotations

import torch

from tests.gpu.checks import check

FP8_MAX = 448.0
# name, K (input), N (output), bias: Qwen2.5-7B's dense layers, one rank
SHAPES_7B = [
    ("qkv_proj", 3584, 4608, True),
    ("o_proj", 3584, 3584, False),
    ("gate_up_proj", 3584, 37888, False),
    ("down_proj", 18944, 3584, False),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 product of x and w each quantized here per row to float8_e4m3fn (scale amax/448), dequantized."""

    def q(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        s = (t.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
        return (t / s).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn).double() * s  # cast as torch does

    y = q(x) @ q(w).T
    return y if bias is None else y + bias.double()


def fp8_linear_layer(device: torch.device, dtype: torch.dtype, cls=None, *args, **kw):
    """A linear layer (cls(*args, **kw), default ReplicatedLinear) built under quantization="fp8" on device in
    dtype; its weight stays dense until process_weights_after_loading."""
    from novainfer.layers.linear import ReplicatedLinear
    from novainfer.layers.quantization import building_with
    from novainfer.layers.quantization.fp8 import Fp8Config

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), building_with(Fp8Config(device)):
            return (cls or ReplicatedLinear)(*args, **kw)
    finally:
        torch.set_default_dtype(prev)


def fp8_layer_checks(
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    shapes=SHAPES_7B,
    rows=(1, 37, 512),
    tight: float = 1e-2,
    loose: float = 6e-2,
    fast_tol: float = 2e-2,
) -> None:
    """tight: exact (float32) accumulation against the reference; fast_tol: the layer as configured, where Hopper's
    fast float8 accumulation (fewer accumulator bits over K) is on."""
    import dataclasses

    from novainfer.layers.quantization.fp8 import fp8_linear

    dev = torch.device(device)
    for name, k, n, has_bias in shapes:
        g = torch.Generator(device=dev).manual_seed(k + n)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype)
        w[n // 3] = 0  # a zero row: its scale is floored and its outputs are the bias alone
        b = torch.randn(n, device=dev, generator=g).to(dtype) if has_bias else None
        layer = fp8_linear_layer(dev, dtype, None, k, n, bias=has_bias)
        layer.weight.weight_loader(layer.weight, w)
        if has_bias:
            layer.bias.weight_loader(layer.bias, b)
        layer.quant_method.process_weights_after_loading(layer)
        opts = layer.quant_method.opts
        exact = dataclasses.replace(opts, fast_accum=False)
        errs, exact_errs, dense_errs, finite = [], [], [], True
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            y = layer(x)
            finite &= bool(torch.isfinite(y).all()) and y.dtype == dtype and y.shape == (m, n)
            want = fp8_reference(x, w, b)
            errs.append(rel(y, want))
            exact_errs.append(rel(fp8_linear(x, layer.weight, layer.weight_scale, b, exact), want))
            dense_errs.append(rel(y, torch.nn.functional.linear(x, w, b)))
        ok = (
            finite
            and layer.weight.dtype == torch.float8_e4m3fn
            and max(exact_errs) <= tight
            and max(errs) <= (fast_tol if opts.fast_accum else tight)
            and max(dense_errs) <= loose
        )
        check(
            f"fp8 linear {name} [{n}x{k}] {str(dtype).split('.')[-1]}",
            f"M={list(rows)}: rel err vs dequantized ref {max(exact_errs):.1e} (exact accumulation), "
            f"{max(errs):.1e} (fast_accum={opts.fast_accum}); vs {str(dtype).split('.')[-1]} linear "
            f"{max(dense_errs):.1e}",
            ok,
        )
        if dev.type == "cuda":
            kernel_vs_torch(x, k)
        del layer


def kernel_vs_torch(x: torch.Tensor, k: int) -> None:
    """The Triton per-token quantization (what CUDA runs) against the torch ops: same scales, same float8 bytes."""
    from novainfer.layers.quantization.fp8 import quantize_rows, quantize_rows_triton, same_quantization

    q, s = quantize_rows_triton(x)
    want_q, want_s = quantize_rows(x)
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    scale_err = ((s - want_s).abs() / want_s).max().item()
    check(
        f"fp8 per-token quant kernel K={k}",
        f"{x.shape[0]} rows: scales' max rel diff {scale_err:.1e}, "
        f"{differ} of {q.numel()} float8 values differ (each by rounding at most)",
        same_quantization(q, s, want_q, want_s) and differ <= q.numel() * 1e-3,
    )


def prompt_logits(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits at every position of P prompts of length L (ids [P, L]) in one prefill over a fresh paged cache."""
    from novainfer.attention import torch_backend
    from novainfer.attention.metadata import AttentionMetadata, attention_metadata
    from novainfer.layers.attention import Attention
    from novainfer.worker.kv_cache import allocate_kv_cache, release_kv_cache

    p, length = ids.shape
    bs, dev = 16, ids.device
    nblk = (length + bs - 1) // bs
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    allocate_kv_cache(layers, p * nblk, bs, dtype, dev, torch_backend)
    qsl = [i * length for i in range(p + 1)]
    slots = (torch.arange(p, device=dev)[:, None] * nblk * bs + torch.arange(length, device=dev)).reshape(-1)
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device=dev),
        torch.full((p,), length, dtype=torch.int32, device=dev),
        slots,
        torch.arange(p * nblk, dtype=torch.int32, device=dev).view(p, nblk),
        length,
        length,
        qsl,
        [length] * p,
    )
    try:
        with torch.inference_mode(), attention_metadata(meta):
            hidden = model(ids.reshape(-1), torch.arange(length, device=dev).repeat(p))
            return model.compute_logits(hidden).float()
    finally:
        release_kv_cache(layers)


def fp8_logits_check(
    path: str,
    label: str,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    prompts: int = 8,
    length: int = 64,
    max_rel: float = 0.3,
    min_top1: float = 0.5,
    load_format: str = "auto",
) -> None:
    """The checkpoint at path with quantization="fp8" against itself unquantized, same dtype, same prompts; with
    dtype other than float32, the unquantized model against float32 too, as a yardstick.

    The bounds are loose because the benchmark checkpoints have random weights (flat logits, no outliers):
    measured on the CPU, float32, random Qwen2.5-0.5B shape, 4x64 positions: rel err 0.20, top-1 0.63. A broken
    fp8 path gives rel err ~1 and chance agreement; the layer checks above carry the tight bounds."""
    import gc

    from novainfer.config import ModelConfig
    from novainfer.layers.quantization.selector import get_quant_config
    from novainfer.loader.model_loader import load_hf_config, load_model

    dev = torch.device(device)
    hf = load_hf_config(path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(hf.vocab_size, 10000), (prompts, length), generator=g).to(dev)
    logits = {}
    runs = [(None, dtype), ("fp8", dtype)] + ([(None, torch.float32)] if dtype != torch.float32 else [])
    for q, dt in runs:
        quant = get_quant_config(ModelConfig(model=path, hf_config=hf, quantization=q), dev)
        model = load_model(path, hf, dt, dev, load_format, quant)
        logits[q, dt] = prompt_logits(model, ids, dt)
        del model
        gc.collect()
    dense, fp8 = logits[None, dtype], logits["fp8", dtype]
    e, agree = rel(fp8, dense), top1(fp8, dense)
    name = str(dtype).split(".")[-1]
    yardstick = (
        ""
        if len(runs) == 2
        else (
            f"; {name} vs float32 (yardstick): rel err "
            f"{rel(dense, logits[None, torch.float32]):.3f}, top-1 "
            f"{top1(dense, logits[None, torch.float32]):.3f}"
        )
    )
    check(
        f"fp8 logits vs {name}, {label}",
        f"{prompts}x{length} positions: rel err {e:.3f}, top-1 agreement {agree:.3f}{yardstick}",
        e <= max_rel and agree >= min_top1,
    )


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()

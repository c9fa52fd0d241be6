"""gpt-oss (bf16/fp32 weights and MXFP4 experts) on a GPU, in one call:

(a) attention sinks in the Triton decode (one program per KV head, and split contexts) and prefill kernels
    against the torch reference, on gpt-oss-20b's head shapes (64 query heads, 8 KV heads, head_dim 64) with
    its window (128) and without, bf16 and fp32;
(b) the MoE kernels (grouped GEMMs with the expert biases, the clamped SwiGLU) against the torch reference on
    gpt-oss-20b's expert shape (32 experts, top 4, hidden = intermediate = 2880), bf16;
(c) the engine's greedy tokens against transformers in fp32 on the GPU, on tests/test_gpt_oss.py's tiny random
    checkpoint (sliding + full layers, YaRN, sinks, biased router and experts), prefix caching off and on; and
    on the same checkpoint with MXFP4 experts (the Triton MXFP4 kernel) against transformers' dequantization;
(d) throughput (256 prompts x 512 + 256 tokens) and batch-1 decode latency of the gpt-oss-20b shape with random
    weights (load_format dummy), bf16 experts and MXFP4 experts (random codes), and the memory its weights take.
Prints one table; exits non-zero when a check fails.

    python3 tests/gpu/gpt_oss_checks.py          # on the GPU machine
    python3 tests/gpu/gpt_oss_checks.py --tiny   # the same steps on the CPU (TRITON_INTERPRET=1): tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.checks import check, paged_case, rows  # noqa: E402
from tests.gpu.family_checks import rel  # noqa: E402

# gpt-oss-20b's published configuration (the released checkpoint's config.json, without its MXFP4 experts)
GPT_OSS_20B = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=None,
)
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)  # bf16 would not fit one GPU
TINY_SHAPE = dict(
    GPT_OSS_20B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=512,
    rope_parameters={**GPT_OSS_20B["rope_parameters"], "factor": 32.0, "original_max_position_embeddings": 16},
)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sink_kernel_checks(dev: str, tiny: bool) -> None:
    """(a): decode (1 and 8 splits) and prefill with sinks, window 128 and none, against the fp32 reference."""
    from novainfer.attention import torch_backend
    from novainfer.kernels.paged_attention import decode_attention, prefill_attention

    nh, nkv, hd, window, bs = (8, 2, 16, 8, 4) if tiny else (64, 8, 64, 128, 16)
    ctx = [0, 5, 40, 300] if tiny else [0, 100, 127, 128, 129, 1000, 4000]
    g = torch.Generator(device=dev).manual_seed(0)
    sinks = (torch.rand(nh, device=dev, generator=g) * 8 - 4).float()
    # Triton's CPU interpreter computes bf16 tiles wrong (with or without sinks): fp32 only there
    for dtype in (torch.float32,) if dev == "cpu" else (torch.bfloat16, torch.float32):
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        q, kc, vc, bt, meta = paged_case(dev, g, ctx, [1] * len(ctx), bs, nh, nkv, hd, dtype)
        for w in (window, None):
            ref = torch_backend.paged_attention(q.float(), kc.float(), vc.float(), meta, hd**-0.5, w, None, sinks)
            for splits in (1, 8):
                out = decode_attention(q, kc, vc, bt, meta.seq_lens, hd**-0.5, splits, sliding_window=w, sinks=sinks)
                err = rel(out.float(), ref)
                check(
                    f"decode sinks {str(dtype)[6:]} splits={splits} window={w}",
                    f"rel err {err:.2e} (tol {tol:g}), {nh}/{nkv} heads d={hd}, contexts {ctx}",
                    err < tol,
                )
        pctx, plen = ([0, 9, 30], [20, 7, 33]) if tiny else ([0, 100, 700], [300, 64, 513])
        q, kc, vc, bt, meta = paged_case(dev, g, pctx, plen, bs, nh, nkv, hd, dtype)
        for w in (window, None):
            out = prefill_attention(
                q,
                kc,
                vc,
                bt,
                meta.query_start_loc,
                meta.seq_lens,
                meta.max_query_len,
                hd**-0.5,
                sliding_window=w,
                sinks=sinks.to(dtype),
            )
            ref = torch_backend.paged_attention(
                q.float(), kc.float(), vc.float(), meta, hd**-0.5, w, None, sinks.to(dtype).float()
            )
            err = rel(out.float(), ref)
            check(
                f"prefill sinks {str(dtype)[6:]} window={w}",
                f"rel err {err:.2e} (tol {tol:g}), cached {pctx} + new {plen}",
                err < tol,
            )


def moe_kernel_checks(dev: str, tiny: bool) -> None:
    """(b): the Triton experts (bias epilogues, clamped SwiGLU) against the torch loop, bf16 inputs."""
    from novainfer.kernels.fused_moe import fused_experts
    from novainfer.layers.activation import ClampedSwigluAndMul
    from novainfer.layers.fused_moe import fused_experts_torch
    from novainfer.layers.fused_moe.routing import select_experts_top_logits

    shape = TINY_SHAPE if tiny else GPT_OSS_20B
    e, k, h, inter = (
        shape[n] for n in ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size")
    )
    g = torch.Generator(device=dev).manual_seed(1)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(e, h, inter, device=dev, generator=g) * 0.05).to(dtype)
    b13 = torch.randn(e, 2 * inter, device=dev, generator=g).to(dtype)
    b2 = torch.randn(e, h, device=dev, generator=g).to(dtype)
    act = ClampedSwigluAndMul(1.702, 7.0)
    for tokens in (1, 64) if tiny else (1, 64, 2048):
        x = torch.randn(tokens, h, device=dev, generator=g).to(dtype)
        weights, ids = select_experts_top_logits(torch.randn(tokens, e, device=dev, generator=g), k)
        out = fused_experts(x, w13, w2, weights, ids, act, b13, b2)
        up = [t.float() for t in (x, w13, w2)]
        ref = fused_experts_torch(up[0], up[1], up[2], weights, ids, act, b13.float(), b2.float())
        err, tol = rel(out.float(), ref), (2e-2 if dtype == torch.bfloat16 else 1e-5)
        check(f"moe experts {tokens} tokens", f"rel err {err:.2e} (tol {tol:g}), {e} experts top {k}, h={h}", err < tol)


def model_checks(dev: str, n: int) -> None:
    """(c): greedy tokens of the tiny checkpoint (float experts, then MXFP4 experts), fp32 on the device, against
    transformers fp32 on the device (on its own dequantization of the MXFP4 experts)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    from novainfer import LLM, SamplingParams
    from tests.test_gpt_oss import PROMPTS, save_tiny, save_tiny_mxfp4
    from tests.tiny_models import hf_greedy_logprobs

    for experts, save in (("float", save_tiny), ("mxfp4", save_tiny_mxfp4)):
        path = save(tempfile.mkdtemp(prefix=f"gpt_oss_tiny_{experts}_"))
        quant = {"quantization_config": Mxfp4Config(dequantize=True)} if experts == "mxfp4" else {}
        model = GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, **quant).to(dev).eval()
        for module in model.modules():  # transformers < 5.2x fixes alpha and limit in the module, not the config
            if hasattr(module, "limit") and hasattr(module, "alpha"):
                module.alpha = getattr(model.config, "swiglu_alpha", module.alpha)
                module.limit = getattr(model.config, "swiglu_limit", module.limit)
        llm = None
        for prefix in (False, True) if experts == "float" else (True,):
            llm = LLM(
                path,
                dtype="float32",
                block_size=4 if dev == "cpu" else 16,
                max_num_batched_tokens=16,
                enable_prefix_caching=prefix,
                gpu_memory_utilization=0.3,
            )
            tok = llm.get_tokenizer()
            prompts = [tok.encode(p) for p in PROMPTS]
            prompts.append(prompts[1] + tok.encode(" Paris is"))  # extends a prompt: a prefix-cache hit
            if prefix is False or experts == "mxfp4":
                with torch.device(dev):
                    refs = [t for t, _ in hf_greedy_logprobs(model, prompts, n)]
            greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, refs))
            check(
                f"tiny fp32 {experts} experts vs HF, prefix cache {'on' if prefix else 'off'}",
                f"{same}/{len(prompts)} prompts equal, {n} tokens each",
                same == len(prompts),
            )
            llm.llm_engine.shutdown()
            del llm
            release()
        del model
        release()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, and of the MXFP4 experts' CPU panels where they were repacked into them."""
    packed = sum(w.nbytes() for m in model.modules() for part in (getattr(m, "mxfp4_packed", None) or ()) for w in part)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed


def bench(dev: str, tiny: bool, experts: str, size: str = "20b") -> None:
    """(d): the gpt-oss-20b (or 120b) shape, random weights drawn in place (experts "float": in the model's dtype;
    "mxfp4": random codes kept in four bits): tok/s of a batch and batch-1 ms per token."""
    import random

    import transformers

    from benchmarks.checkpoints import word_level_tokenizer
    from novainfer import LLM, SamplingParams
    from novainfer.loader.gguf_gpt_oss import QUANTIZATION_CONFIG

    shape = TINY_SHAPE if tiny else GPT_OSS_120B if size == "120b" else GPT_OSS_20B
    path = tempfile.mkdtemp(prefix=f"gpt_oss_{size}_shape_")
    config = transformers.GptOssConfig(
        **shape, **({"quantization_config": QUANTIZATION_CONFIG} if experts == "mxfp4" else {})
    )
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(path)
    word_level_tokenizer(config.vocab_size).save_pretrained(path)
    kw = {"dtype": "bfloat16", "gpu_memory_utilization": 0.9} if dev == "cuda" else {"dtype": "float32"}
    before = torch.cuda.memory_allocated() if dev == "cuda" else 0
    llm = LLM(path, load_format="dummy", max_model_len=4096 if dev == "cuda" else 256, **kw)
    runner = llm.llm_engine.executor.workers[0].model_runner
    weights_gb = weight_bytes(runner.model) / 1e9
    num, inp, outl = (4, 32, 16) if tiny else (256, 512, 256)
    rng = random.Random(0)
    top = min(config.vocab_size, 10000) - 1
    prompts = [{"prompt_token_ids": [rng.randint(2, top) for _ in range(inp)]} for _ in range(num)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.6, max_tokens=outl, ignore_eos=True, seed=0), use_tqdm=False
    )
    elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    one = prompts[0]["prompt_token_ids"][:128]

    def timed(k: int) -> float:
        t = time.perf_counter()
        greedy = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        llm.generate([{"prompt_token_ids": one}], greedy, use_tqdm=False)
        return time.perf_counter() - t

    timed(8)
    steps = 16 if tiny else 256
    decode_ms = (min(timed(steps + 1) for _ in range(2)) - min(timed(1) for _ in range(2))) / steps * 1e3
    name = "tiny gpt-oss shape" if tiny else f"gpt-oss-{size} shape"
    dtype = "bf16" if dev == "cuda" else "fp32"
    check(
        f"bench {name} ({dtype}, {experts} experts, dummy)",
        f"{gen / elapsed:.0f} tok/s ({num} x {inp}+{outl}), batch-1 decode {decode_ms:.2f} ms/token, "
        f"weights {weights_gb:.1f} GB, graphs {'on' if getattr(runner, 'graphs', None) is not None else 'off'}"
        + (f", device memory before load {before / 1e9:.1f} GB" if dev == "cuda" else ""),
        gen == num * outl,
    )
    llm.llm_engine.shutdown()
    release()


def report() -> None:
    print(f"\n{'check':<58} {'ok':<5} detail")
    for name, detail, ok in rows:
        print(f"{name:<58} {'PASS' if ok else 'FAIL':<5} {detail}")
    failed = [r for r in rows if not r[2]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} passed")
    sys.exit(1 if failed else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the CPU, tiny shapes (Triton interpreted)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["sinks", "moe", "hf", "bench", "bench-float"])
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("gpt_oss_checks needs a CUDA GPU (or --tiny)")
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}",
        flush=True,
    )
    t = time.perf_counter()
    if "sinks" not in args.skip:
        sink_kernel_checks(dev, args.tiny)
    if "moe" not in args.skip:
        moe_kernel_checks(dev, args.tiny)
    if "hf" not in args.skip:
        model_checks(dev, 8 if args.tiny else 24)
    print(f"checks took {time.perf_counter() - t:.0f} s", flush=True)
    if "bench" not in args.skip:
        for experts in ("float", "mxfp4"):
            if experts != "float" or "bench-float" not in args.skip:
                bench(dev, args.tiny, experts)
        if not args.tiny:
            bench(dev, False, "mxfp4", "120b")
    report()


if __name__ == "__main__":
    main()

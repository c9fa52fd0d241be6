"""The fp8 KV cache (kv_cache_dtype="fp8") on the GPU, in one run:

1. Kernels on Qwen2.5-7B's attention shape (28 heads, 4 KV heads, head_dim 128, blocks of 16), bf16 queries: the
   KV-store kernel's e4m3 values against the torch reference's (equal), the decode kernel (one program, split
   contexts) and the prefill kernel (fresh prompts, chunks after a cached prefix) over an fp8 cache against the
   torch reference on the same dequantized cache (bf16 tolerance) and against the bf16 K/V (loose), and the decode
   kernel's time over an fp8 and a bf16 cache (batch 64, 4k contexts).
2. Engine, random:qwen2.5-7b, bf16 KV then fp8 KV in the same run: KV capacity in tokens (the engine's block count),
   bench-shape throughput (benchmarks/throughput.py's workload: 256 prompts of 100-1024 tokens, 100-1024 new
   tokens, ignore_eos), free-running greedy agreement, and teacher-forced top-1 agreement over a few hundred
   positions (prompt logprobs of the bf16 run's greedy sequences through both caches; random weights give flat
   logits, so the agreement where bf16's top-2 margin is over 0.1 nats is printed beside).

GPU:  python tests/gpu/fp8_kv_check.py
CPU:  TRITON_INTERPRET=1 python tests/gpu/fp8_kv_check.py --tiny   (tiny shapes, float32 activations, the Triton
      kernels interpreted; the CPU's KV budget is in tokens, so capacity is compared in bytes per token there)
Prints one table with the targets beside (capacity 2x, throughput not lower, agreement >= 99%); exits 1 if a
kernel check fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from benchmarks.throughput import make_workload, sync  # noqa: E402
from tests.gpu.checks import check, paged_case, rows  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kernel_checks(dev: str, tiny: bool) -> list[tuple[str, str, str, str, str]]:
    """Store, decode and prefill over an fp8 cache against the torch reference; returns the timing rows."""
    from novainfer.attention import torch_backend
    from novainfer.kernels.kv_fp8 import to_fp8
    from novainfer.kernels.kv_store import store_kv
    from novainfer.kernels.paged_attention import decode_attention, prefill_attention

    heads, kv_heads, hd, bs = (4, 2, 32, 4) if tiny else (28, 4, 128, 16)
    dtype = torch.float32 if tiny else torch.bfloat16  # the interpreter has no bfloat16 arithmetic
    ks, vs = 0.04, 0.03
    g = torch.Generator(device=dev).manual_seed(0)

    n = 64 if tiny else 4096
    key = torch.randn(n, kv_heads, hd, device=dev, generator=g).to(dtype) * 3
    value = torch.randn(n, kv_heads, hd, device=dev, generator=g).to(dtype)
    slots = torch.randperm(2 * n, device=dev, generator=g)[:n]
    caches = [torch.zeros(2 * n // bs, bs, kv_heads, hd, dtype=torch.float8_e4m3fn, device=dev) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, ks, vs)
    torch_backend.store_kv(key, value, caches[2], caches[3], slots, ks, vs)
    diff = sum(int((a.float() != b.float()).sum()) for a, b in zip(caches[:2], caches[2:]))
    check("store: e4m3 values = torch reference", f"{n} tokens, {diff} values differ", diff == 0)

    ctx = [0, 5, 37, 130] if tiny else [0, 100, 1000, 4000, 8191]
    for splits in (1, 4 if tiny else 16):
        q, kc, vc, bt, meta = paged_case(dev, g, ctx, [1] * len(ctx), bs, heads, kv_heads, hd, dtype)
        k8, v8 = to_fp8(kc, ks), to_fp8(vc, vs)
        out = decode_attention(q, k8, v8, bt, meta.seq_lens, hd**-0.5, splits, k_scale=ks, v_scale=vs)
        ref = torch_backend.paged_attention(q.float(), k8, v8, meta, hd**-0.5, k_scale=ks, v_scale=vs)
        full = torch_backend.paged_attention(q.float(), kc, vc, meta, hd**-0.5)
        e, e_full = rel_err(out, ref), rel_err(out, full)
        tol = 1e-5 if tiny else 1e-2
        check(f"decode, {splits} split(s): fp8 = reference", f"rel err {e:.1e} (< {tol}); vs unquantized KV {e_full:.1e}",
              e < tol and e_full < 0.1)  # fmt: skip
    ctx, qlen = ([0, 9, 3], [7, 5, 21]) if tiny else ([0, 1000, 37], [512, 300, 1000])
    q, kc, vc, bt, meta = paged_case(dev, g, ctx, qlen, bs, heads, kv_heads, hd, dtype)
    k8, v8 = to_fp8(kc, ks), to_fp8(vc, vs)
    out = prefill_attention(q, k8, v8, bt, meta.query_start_loc, meta.seq_lens, max(qlen), 0.1, k_scale=ks, v_scale=vs)
    ref = torch_backend.paged_attention(q.float(), k8, v8, meta, 0.1, k_scale=ks, v_scale=vs)
    e, e_full = rel_err(out, ref), rel_err(out, torch_backend.paged_attention(q.float(), kc, vc, meta, 0.1))
    tol = 1e-5 if tiny else 1e-2
    check(
        "prefill: fp8 = reference",
        f"rel err {e:.1e} (< {tol}); vs unquantized KV {e_full:.1e}",
        e < tol and e_full < 0.1,
    )

    if tiny:
        return []
    from triton.testing import do_bench

    q, kc, vc, bt, meta = paged_case(dev, g, [4095] * 64, [1] * 64, bs, heads, kv_heads, hd, dtype)
    k8, v8 = to_fp8(kc, ks), to_fp8(vc, vs)
    t16 = do_bench(lambda: decode_attention(q, kc, vc, bt, meta.seq_lens, hd**-0.5, 4), return_mode="median")
    t8 = do_bench(lambda: decode_attention(q, k8, v8, bt, meta.seq_lens, hd**-0.5, 4, k_scale=ks, v_scale=vs),
                  return_mode="median")  # fmt: skip
    return [("decode kernel, 64 x 4k ctx (us)", f"{t16 * 1e3:.0f}", f"{t8 * 1e3:.0f}", f"{t16 / t8:.2f}x", "faster")]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def top_tokens(llm, seqs: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Each sequence's teacher-forced top-1 token at every position after the first, and its margin over the
    second (nats)."""
    from novainfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    result = []
    for o in outs:
        row = []
        for d in o.prompt_logprobs[1:]:
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank <= 2)
            row.append((ranked[0][1], ranked[0][2] - ranked[1][2]))
        result.append(row)
    return result


def engine_run(model: str, kv: str, args: argparse.Namespace, seqs: list[list[int]] | None) -> dict:
    """One engine with kv_cache_dtype=kv: capacity, throughput, greedy sequences and teacher-forced tops."""
    from novainfer import LLM, SamplingParams

    llm = LLM(resolve_model(model), load_format=load_format(model), kv_cache_dtype=kv, **args.engine)
    engine = llm.llm_engine
    runner = engine.executor.workers[0].model_runner
    r = {
        "capacity": engine.block_manager.num_blocks * engine.config.cache_config.block_size,
        "bytes_per_token": runner.kv_bytes_per_block() // runner.block_size,
        "dtype": str(runner.kv_cache.dtype).replace("torch.", ""),
    }
    vocab = engine.config.model_config.hf_config.vocab_size
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, seed=0)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outs]
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    sync()
    t0 = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    r["tok_s"] = sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - t0)
    starts, _ = make_workload(args.agree_prompts, args.agree_prompt_len, None, vocab, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=args.agree_new, ignore_eos=True)
    done = llm.generate([{"prompt_token_ids": p} for p in starts], greedy, use_tqdm=False)
    r["greedy"] = [p + list(o.outputs[0].token_ids) for p, o in zip(starts, done)]
    r["tops"] = top_tokens(llm, seqs or r["greedy"])
    engine.shutdown()
    del llm, engine, runner
    release()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--model", default=None, help="default: random:qwen2.5-7b (GPU), random:tiny (--tiny)")
    ap.add_argument("--num-prompts", type=int, default=None, help="bench-shape prompts (default 256)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if args.tiny and not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    model = args.model or ("random:qwen2.5-7b" if cuda else "random:tiny")
    args.num_prompts = args.num_prompts or (256 if cuda else 4)
    args.input_len, args.output_len = (None, None) if cuda else (12, 6)
    args.agree_prompts, args.agree_prompt_len, args.agree_new = (3, 64, 160) if cuda else (2, 8, 10)
    args.engine = (
        {"max_model_len": 4096}
        if cuda
        else {"device": "cpu", "dtype": "float32", "attention_backend": "triton", "block_size": 4}
    )
    dev = "cuda" if cuda else "cpu"
    t_start = time.perf_counter()
    timing = kernel_checks(dev, not cuda)

    ref = engine_run(model, "bfloat16" if not cuda else "auto", args, None)
    fp8 = engine_run(model, "fp8", args, ref["greedy"])
    check("fp8 engine's cache is float8_e4m3fn", fp8["dtype"], fp8["dtype"] == "float8_e4m3fn")
    pairs = [(a, b) for ra, rb in zip(ref["tops"], fp8["tops"]) for a, b in zip(ra, rb)]
    agree = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    clear = [(a, b) for a, b in pairs if a[1] > 0.1]
    agree_clear = sum(a[0] == b[0] for a, b in clear) / max(1, len(clear))
    n_new = args.agree_new
    free = [(a[-n_new:], b[-n_new:]) for a, b in zip(ref["greedy"], fp8["greedy"])]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n_new) for a, b in free]

    cap_ratio = fp8["capacity"] / ref["capacity"]
    byte_ratio = ref["bytes_per_token"] / fp8["bytes_per_token"]
    rate_ratio = fp8["tok_s"] / ref["tok_s"]
    table = [
        ("KV capacity (tokens)", f"{ref['capacity']:,}", f"{fp8['capacity']:,}", f"{cap_ratio:.2f}x",
         "2x" + ("" if cuda else " (CPU: token budget)")),
        ("KV bytes per token", f"{ref['bytes_per_token']:,}", f"{fp8['bytes_per_token']:,}", f"{byte_ratio:.2f}x",
         "2x"),
        (f"throughput, {args.num_prompts} prompts (tok/s)", f"{ref['tok_s']:,.0f}", f"{fp8['tok_s']:,.0f}",
         f"{rate_ratio:.2f}x", ">= 1x"),
        (f"teacher-forced top-1 agreement ({len(pairs)} positions)", "-", f"{agree:.2%}", "", ">= 99%"),
        (f"  where bf16's top-2 margin > 0.1 nats ({len(clear)} positions)", "-", f"{agree_clear:.2%}", "", ""),
        (f"greedy: first differing new token of {n_new}", "-", ", ".join(map(str, first)), "", "report"),
        *timing,
    ]  # fmt: skip
    name = torch.cuda.get_device_name() if cuda else "cpu (tiny, interpreted kernels)"
    print(f"\nfp8 KV cache, {model} on {name}, torch {torch.__version__}, {time.perf_counter() - t_start:.0f} s")
    print("| check | result |\n|---|---|")
    for c, detail, ok in rows:
        print(f"| {c}: {detail} | {'PASS' if ok else 'FAIL'} |")
    print("\n| metric | bf16 KV | fp8 KV | fp8 / bf16 | target |\n|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

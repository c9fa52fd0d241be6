"""Batch-invariant mode (EngineConfig.batch_invariant, `--batch-invariant`): bits and cost, in one run.

1. Kernel: kernels/batch_invariant.linear gives each row the same bits for every number of rows (and F.linear, the
   mode-off GEMM, is reported for comparison), close to F.linear.
2. Engine: one greedy request's tokens and logprobs alone, then inside batches of other prompts, with the mode on
   (must be bit-identical) and off (reported: whether it differs).
3. Cost: offline throughput on the bench shape (random prompts of 100-1024 tokens, 100-`--max-output` new tokens,
   ignore_eos) with the mode off and on, in the same run.

GPU:  python tests/gpu/batch_invariance_check.py            (Qwen2.5-7B's shape, random weights, load_format dummy)
CPU:  TRITON_INTERPRET=1 python tests/gpu/batch_invariance_check.py --tiny   (tiny shapes, float32 kernel check;
      the engine runs its CPU paths, which are batch-invariant without the mode)
Prints one table; exits 1 if a check that must hold fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from benchmarks.throughput import make_workload  # noqa: E402
from novainfer import LLM, SamplingParams  # noqa: E402
from novainfer.kernels import batch_invariant  # noqa: E402

rows: list[tuple[str, str, bool | None]] = []  # (check, result, must-hold verdict or None for a report)


def kernel_check(device: str, dtype: torch.dtype, k: int, n: int, sizes: list[int]) -> None:
    """Row 0..2 of x through the fixed-tile GEMM inside every batch size: equal bits; F.linear reported."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=g, device=device).to(dtype) / k**0.5
    x = torch.randn(max(sizes), k, generator=g, device=device).to(dtype)
    ref_bi, ref_cublas = batch_invariant.linear(x[:1], w), F.linear(x[:1], w)
    same_bi = all(torch.equal(batch_invariant.linear(x[:m], w)[:1], ref_bi) for m in sizes)
    same_off = all(torch.equal(F.linear(x[:m], w)[:1], ref_cublas) for m in sizes)
    err = (ref_bi.float() - F.linear(x[:1].float(), w.float())).abs().max().item()
    rows.append((f"linear {k}->{n} {dtype}: a row alone == in M={sizes}, mode on", str(same_bi), same_bi))
    rows.append((f"linear {k}->{n}: same with F.linear (mode off)", str(same_off), None))
    close = err < (3e-2 if dtype == torch.bfloat16 else 1e-4)
    rows.append((f"linear {k}->{n}: max |on - float32 reference|", f"{err:.2e}", close))


def answers(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in outs
    ]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_checks(model: str, mode: bool, batches: list[int], args: argparse.Namespace, vocab: int) -> float:
    """Bits alone vs in batches (a row each), then the throughput run; returns output tokens per second."""
    path = resolve_model(model)
    llm = LLM(path, load_format=load_format(model), batch_invariant=mode, max_model_len=2048, **args.engine)
    prompts, _ = make_workload(max(batches), None, None, vocab, seed=1)
    prompts = [p[: args.max_prompt] for p in prompts]
    target = prompts[0]
    alone = answers(llm, [target], args.check_tokens)[0]
    for b in batches:
        together = answers(llm, [target] + prompts[1:b], args.check_tokens)[0]
        same = together == alone
        first = next((i for i, (a, t) in enumerate(zip(alone[1], together[1])) if a != t), None)
        verdict = same if mode else None
        detail = (
            "equal" if same else f"differs (tokens equal: {together[0] == alone[0]}, first logprob diff at {first})"
        )
        rows.append((f"mode {'on' if mode else 'off'}: request alone == in a batch of {b}", detail, verdict))
    bench, outs = make_workload(args.num_prompts, None, None, vocab, seed=0)
    bench = [p[: args.max_prompt] for p in bench]
    params = [SamplingParams(temperature=0, max_tokens=min(o, args.max_output), ignore_eos=True) for o in outs]
    llm.generate(bench[:2], params[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    done = llm.generate(bench, params, use_tqdm=False)
    rate = sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - t)
    del llm
    release()
    return rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--model", default=None, help="default: random:qwen2.5-7b (GPU), random:tiny (--tiny)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-output", type=int, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if args.tiny and not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    model = args.model or ("random:qwen2.5-7b" if cuda else "random:tiny")
    args.num_prompts = args.num_prompts or (256 if cuda else 6)
    args.max_output = args.max_output or (512 if cuda else 8)
    args.max_prompt = 1024 if cuda else 48
    args.check_tokens = 64 if cuda else 6
    args.engine = {} if cuda else {"dtype": "bfloat16"}
    batches = [2, 8, 32, 128] if cuda else [2, 5]
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

    t0 = time.perf_counter()
    batch_invariant.set_enabled(True)
    shapes = [(3584, 4608), (18944, 3584), (3584, 152064)] if cuda else [(96, 130), (200, 40)]
    for k, n in shapes:
        kernel_check(device, dtype, k, n, [1, 2, 3, 17, 64, 200, 1000] if cuda else [1, 2, 3, 70])
    batch_invariant.set_enabled(False)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(resolve_model(model)).vocab_size
    rate_off = engine_checks(model, False, batches, args, vocab)
    rate_on = engine_checks(model, True, batches, args, vocab)
    rows.append((f"throughput mode off ({args.num_prompts} prompts, {model})", f"{rate_off:,.0f} tok/s", None))
    rows.append(("throughput mode on", f"{rate_on:,.0f} tok/s ({rate_on / rate_off:.2f}x of off)", None))

    name = torch.cuda.get_device_name() if cuda else "cpu (tiny, interpreted kernels)"
    print(f"\nbatch invariance on {name}, torch {torch.__version__}, {time.perf_counter() - t0:.0f} s")
    print("| check | result | verdict |\n|---|---|---|")
    for check, result, ok in rows:
        print(f"| {check} | {result} | {'report' if ok is None else ('PASS' if ok else 'FAIL')} |")
    return 0 if all(ok is not False for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

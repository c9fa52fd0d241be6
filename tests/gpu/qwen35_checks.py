"""Hybrid models (Qwen3.5 dense / MoE, Qwen3-Next: Gated DeltaNet + gated attention) on a GPU, in one call:

(a) the engine's greedy tokens against transformers in fp32 on the GPU for tiny random checkpoints (the builders of
    tests/tiny_hybrid.py): a mixed batch in small chunks (prefill chunks and decodes in one step), prefix caching on
    (prompts that extend an earlier one restore its state checkpoint) and off; CUDA graphs on;
(b) bf16 decode through captured CUDA graphs against enforce_eager: identical greedy tokens;
(c) throughput (benchmarks/throughput.py's workload shape, fixed lengths) and batch-1 decode latency of the
    random-weight Qwen3.5-9B shape against Qwen2.5-7B (benchmarks/checkpoints.py, dummy load), in bf16, each model
    in its own subprocess. --moe adds random:qwen3.5-35b-a3b.
Prints one table; exits non-zero when a check fails. fla (fla-core) is imported when installed, else from the
wheels in .whl/ (fla-core, einops), as tests/gpu/gdn_check.py does; the table says whether prefill used it (bf16
only: fp32 runs our chunk kernel). transformers' Qwen3.5 / Qwen3-Next modules are imported before the wheels are
added, so its fp32 reference runs its torch fallbacks (unless fla is installed).

    python3 tests/gpu/qwen35_checks.py            # on the GPU machine (about 6 minutes on an H200)
    python3 tests/gpu/qwen35_checks.py --dry-run  # the same steps on the CPU: tiny shapes, tiny workloads
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.gdn_check import add_fla_wheels  # noqa: E402

rows: list[tuple[str, str, bool]] = []


def check(name: str, detail: str, ok: bool) -> None:
    rows.append((name, detail, ok))
    print(("PASS " if ok else "FAIL ") + f"{name}: {detail}", flush=True)


def release(llm=None) -> None:
    if llm is not None:
        llm.llm_engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def runner_of(llm):
    return llm.llm_engine.engine_core.executor.workers[0].model_runner


def hf_reference(path: str, prompts: list[list[int]], n: int, dev: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import hf_greedy_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    with torch.device(dev):  # hf_greedy_logprobs makes its input tensors on the default device
        refs = [tokens for tokens, _ in hf_greedy_logprobs(model, prompts, n)]
    del model
    release()
    return refs


def correctness(paths: dict[str, str], dev: str, n: int) -> None:
    """(a): each arch, a mixed batch with prefix caching off and on, tokens equal to transformers'."""
    from transformers import AutoTokenizer

    from novainfer import LLM, SamplingParams
    from tests.tiny_hybrid import PROMPTS

    from tests.gpu.decode_stack_checks import counting_stack_calls

    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for arch, path in paths.items():
        tok = AutoTokenizer.from_pretrained(path)
        base = tok.encode(PROMPTS[1])
        prompts = [tok.encode(p) for p in PROMPTS] + [base + tok.encode(" Paris is"), base[:13] + tok.encode(" big")]
        refs = hf_reference(path, prompts, n, dev)
        for prefix in (False, True):
            # the stack runs while the batch-1 decode graph is captured (replays call no Python), so count from
            # construction on; the first prompt alone then decodes in batch-1 steps
            with counting_stack_calls() as calls:
                llm = LLM(
                    path,
                    dtype="float32",
                    block_size=4 if dev == "cpu" else 16,
                    max_num_batched_tokens=8,
                    enable_prefix_caching=prefix,
                    gpu_memory_utilization=0.3,
                    max_num_seqs=8,
                )
                first = llm.generate([{"prompt_token_ids": prompts[1]}], greedy, use_tqdm=False)  # checkpoints base
            stack_steps = sum(calls)
            outs = first + llm.generate(
                [{"prompt_token_ids": p} for i, p in enumerate(prompts) if i != 1], greedy, use_tqdm=False
            )
            order = [1] + [i for i in range(len(prompts)) if i != 1]
            bad = [i for i, o in zip(order, outs) if o.outputs[0].token_ids != refs[i]]
            hits = llm.llm_engine.engine_core.block_manager.num_prefix_hits if prefix else 0
            graphs = runner_of(llm).graphs is not None
            check(
                f"{arch} fp32 vs HF, prefix cache {'on' if prefix else 'off'}",
                f"{len(prompts) - len(bad)}/{len(prompts)} prompts equal, {n} tokens each; prefix hit tokens "
                f"{hits}; decode graphs {'on' if graphs else 'off'}; batch-1 decode stack forwards {stack_steps}",
                not bad and (hits > 0 or not prefix) and (graphs or dev == "cpu") and (stack_steps or dev == "cpu"),
            )
            release(llm)


def graphs_vs_eager(paths: dict[str, str], dev: str, n: int) -> None:
    """(b): bf16 greedy tokens with the decode graphs replayed against enforce_eager."""
    from novainfer import LLM, SamplingParams

    dtype = "bfloat16" if dev == "cuda" else "float32"
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    # 8 prompts of different lengths: a captured batch size, so eager and replay run the same GEMM shapes
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 5 * i))} for i in range(8)]
    for arch in ("qwen3_5", "qwen3_5_moe"):
        outs = {}
        for eager in (False, True):
            llm = LLM(paths[arch], dtype=dtype, enforce_eager=eager, gpu_memory_utilization=0.3, max_num_seqs=8)
            replays = [0]
            graphs = runner_of(llm).graphs
            if graphs is not None:
                replay = graphs.replay
                graphs.replay = lambda k, _r=replay: (replays.__setitem__(0, replays[0] + 1), _r(k))[1]
            outs[eager] = ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)], replays[0])
            release(llm)
        same = outs[False][0] == outs[True][0]
        check(
            f"{arch} {dtype} graphs vs eager",
            f"tokens {'identical' if same else 'DIFFER'}; {outs[False][1]} graph replays",
            same and (outs[False][1] > 0 or dev == "cpu"),
        )


def bench_one(model: str, dev: str, num_prompts: int, input_len: int, output_len: int, out: str) -> None:
    """One model's throughput and batch-1 decode latency (run in a subprocess: a clean GPU per model)."""
    from benchmarks.hybrid_profile import batch1_decode_ms, bench_setup
    from novainfer import SamplingParams
    from novainfer.layers.linear_attention import fla_chunk_rule

    llm, prompts = bench_setup(model, dev, num_prompts, input_len)
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_ms = batch1_decode_ms(llm, prompts[0]["prompt_token_ids"][:128], 64 if dev == "cpu" else 256)
    runner = runner_of(llm)
    result = {
        "model": model,
        "tok_s": gen / elapsed,
        "seconds": elapsed,
        "output_tokens": gen,
        "decode_ms": decode_ms,
        "graphs": runner.graphs is not None,
        "fla": runner.state_cache is not None and dev == "cuda" and fla_chunk_rule() is not None,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
    }
    with open(out, "w") as f:
        json.dump(result, f)


def throughput(models: list[str], dev: str, num_prompts: int, input_len: int, output_len: int) -> None:
    """(c): each model in a subprocess; rows with tok/s and batch-1 ms per decode step, the ratio to the first."""
    results = []
    for model in models:
        out = tempfile.mktemp(suffix=".json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--bench",
            model,
            "--bench-out",
            out,
            "--bench-shape",
            f"{num_prompts},{input_len},{output_len}",
        ] + (["--dry-run"] if dev == "cpu" else [])
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode or not os.path.exists(out):
            print(proc.stdout[-3000:], proc.stderr[-6000:])
            check(f"bench {model}", f"failed (rc {proc.returncode})", False)
            continue
        with open(out) as f:
            r = json.load(f)
        results.append(r)
        dtype = "bf16" if dev == "cuda" else "fp32"
        check(
            f"bench {model}",
            f"{r['tok_s']:.0f} tok/s ({num_prompts} x {input_len}+{output_len}, {dtype}), batch-1 "
            f"decode {r['decode_ms']:.2f} ms/token, graphs {'on' if r['graphs'] else 'off'}"
            + (", fla prefill" if r["fla"] else "")
            + f"; {time.perf_counter() - t:.0f} s wall",
            True,
        )
    if len(results) >= 2:
        base = results[-1]
        for r in results[:-1]:
            check(
                f"ratio {r['model']} / {base['model']}",
                f"throughput x{r['tok_s'] / base['tok_s']:.2f}, batch-1 "
                f"decode step x{r['decode_ms'] / base['decode_ms']:.2f}",
                True,
            )


def build_tiny(tmp: str) -> dict[str, str]:
    from tests.tiny_hybrid import CONFIGS, build

    return {arch: build(os.path.join(tmp, arch), arch) for arch in sorted(CONFIGS)}


def report() -> None:
    print(f"\n{'check':<48} {'ok':<5} detail")
    for name, detail, ok in rows:
        print(f"{name:<48} {'PASS' if ok else 'FAIL':<5} {detail}")
    failed = [r for r in rows if not r[2]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} passed")
    sys.exit(1 if failed else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the CPU, tiny shapes and workloads")
    ap.add_argument("--moe", action="store_true", help="also benchmark random:qwen3.5-35b-a3b")
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf", "graphs", "bench"])
    ap.add_argument("--bench", help=argparse.SUPPRESS)
    ap.add_argument("--bench-out", help=argparse.SUPPRESS)
    ap.add_argument("--bench-shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("qwen35_checks needs a CUDA GPU (or --dry-run)")
    if args.bench:
        if not args.dry_run:  # the CPU has no Triton driver for fla
            add_fla_wheels()
        bench_one(args.bench, dev, *map(int, args.bench_shape.split(",")), args.bench_out)
        return
    import transformers

    for mod in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # bound to the torch fallbacks: no fla on sys.path yet
        try:
            __import__(f"transformers.models.{mod}.modeling_{mod}")
        except ImportError:
            pass
    if not args.dry_run:
        add_fla_wheels()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}",
        flush=True,
    )
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        print(f"transformers {transformers.__version__} has no Qwen3_5 (Qwen3.5 configs do not load): skipped")
        check("transformers Qwen3_5", "missing: the Qwen3.5 checks and benchmarks are skipped", True)
        report()
    from novainfer.layers.linear_attention import fla_chunk_rule

    check(
        "fla chunk_gated_delta_rule",
        "importable: the CUDA prefill uses it"
        if fla_chunk_rule()
        else "not importable: the CUDA prefill uses our chunk kernel",
        True,
    )
    tmp = tempfile.mkdtemp(prefix="qwen35_checks_")
    atexit.register(shutil.rmtree, tmp, True)
    t = time.perf_counter()
    paths = build_tiny(tmp)
    n = 8 if args.dry_run else 16
    if "hf" not in args.skip:
        correctness(paths, dev, n)
    if "graphs" not in args.skip:
        graphs_vs_eager(paths, dev, 2 * n)
    print(f"checks took {time.perf_counter() - t:.0f} s", flush=True)
    if "bench" not in args.skip:
        if args.dry_run:
            throughput([paths["qwen3_5"], "random:tiny"], dev, 4, 32, 16)
        else:
            models = ["random:qwen3.5-9b"] + (["random:qwen3.5-35b-a3b"] if args.moe else []) + ["random:qwen2.5-7b"]
            throughput(models, dev, 256, 512, 256)
    report()


if __name__ == "__main__":
    main()

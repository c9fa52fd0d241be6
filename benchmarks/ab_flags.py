"""Runs a benchmark script with module-level A/B switches set first (the old path behind a flag, in the same
call as the new one), e.g.:

    python3 benchmarks/ab_flags.py --set novainfer.layers.quantization.fp8.FUSE_SILU_AND_MUL=False -- \
        benchmarks/throughput.py --model random:qwen2.5-7b --quantization fp8
    python3 benchmarks/ab_flags.py --blas cublaslt -- benchmarks/latency.py --model random:qwen2.5-0.5b

--set MODULE.NAME=VALUE (VALUE a Python literal) may repeat; --blas picks torch's CUDA BLAS back-end. The script
runs in this process (the uni executor, tp=1, keeps the model here too), so the switches hold for it.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    for item in args.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"{module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
    if args.blas:
        import torch
        torch.backends.cuda.preferred_blas_library(args.blas)
    sys.argv = [args.script, *args.args]
    runpy.run_path(os.path.join(ROOT, args.script), run_name="__main__")


if __name__ == "__main__":
    main()

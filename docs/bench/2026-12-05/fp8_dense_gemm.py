"""Experiment: the block-FP8 Triton GEMM with one weight scale a step (this tree) against 12ed0a2's (.bench/base),
both against bf16 cuBLAS and cuBLAS's block-scaled GEMM, 7B layers, 48-256 rows, FP8 activations."""
import os, sys, importlib.util, json
sys.path.insert(0, os.getcwd())
import torch
from novainfer.kernels import fp8_block as f8
from benchmarks.quant_gpu import SHAPES_7B, Operands, device_us, rel
from novainfer.layers.quantization.fp8_block import block_reference
spec = importlib.util.spec_from_file_location("fp8_block_base", ".bench/base/novainfer/kernels/fp8_block.py")
B = importlib.util.module_from_spec(spec); spec.loader.exec_module(B)
TILES = [(64, 128, 4, 3, 0), (64, 128, 4, 4, 1), (64, 128, 4, 3, 1), (64, 128, 4, 4, 2), (128, 128, 8, 3, 0), (64, 128, 8, 4, 0), (32, 128, 4, 4, 2), (128, 128, 8, 4, 1)]
dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
rows = []
print("| layer | M | bf16 | cublas block | base default | new default | base best | new best (tile) |", flush=True)
for name, k, n in SHAPES_7B:
    ops = Operands(k, n, dev, g)
    for m in (48, 64, 96, 128, 192, 256):
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        want = block_reference(x, ops.wq, ops.ws, (128, 128)).float()
        bf16 = device_us(lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w), 2 * n * k, dev, 20)
        cub = device_us(lambda i: lambda: f8.cublas_block_gemm(x, *ops.copy("fp8", i)), n * k, dev, 20)
        cell = {"layer": name, "m": m, "bf16": bf16, "cublas": cub}
        for tag, mod in (("base", B), ("new", f8)):
            best = None
            for t in [None] + TILES:
                run = lambda i, t=t, mod=mod: (lambda: mod.fp8_block_gemm(*mod.per_token_group_quant(x, 128), *ops.copy("fp8", i), (128, 128), x.dtype, t))
                try:
                    err = rel(run(0)().float(), want)
                    us = device_us(run, n * k, dev, 20)
                except Exception as e:
                    print(f"  {tag} {t}: {type(e).__name__} {str(e)[:120]}", flush=True); continue
                cell[f"{tag} {t}"] = us
                if err > 5e-3: print(f"  {tag} {t} rel {err:.1e}", flush=True)
                if t is not None and (best is None or us < best[0]): best = (us, t)
            cell[f"{tag} best"] = best
        rows.append(cell)
        print(f"| {name} | {m} | {bf16:.1f} | {cub:.1f} ({bf16/cub:.2f}x) | {cell['base None']:.1f} ({bf16/cell['base None']:.2f}x) | {cell['new None']:.1f} ({bf16/cell['new None']:.2f}x) | {cell['base best'][0]:.1f} ({bf16/cell['base best'][0]:.2f}x) | {cell['new best'][0]:.1f} ({bf16/cell['new best'][0]:.2f}x) {cell['new best'][1]} |", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_dense.json"), "w"), indent=1, default=str)

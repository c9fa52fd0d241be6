"""Experiment: the INT4 fused MoE, this tree's kernel (C transposed, scale after the dot) against 12ed0a2's, each
against the bf16 fused MoE, Qwen3-30B-A3B layer; a tile sweep of the new kernel."""
import os, sys, importlib.util, json
sys.path.insert(0, os.getcwd())
import torch
from benchmarks.quant_gpu import MOE_SHAPE, MoeOperands, device_us, rel
from novainfer.kernels import fused_moe_quant as NEW
from novainfer.kernels.fused_moe import fused_experts
from novainfer.layers.activation import get_act_and_mul
from novainfer.layers.fused_moe.routing import select_experts
from novainfer.layers.quantization.int4 import fused_experts_int4_reference
spec = importlib.util.spec_from_file_location("fmq_base", ".bench/base/novainfer/kernels/fused_moe_quant.py")
B = importlib.util.module_from_spec(spec); spec.loader.exec_module(B)
dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
shape = MOE_SHAPE; ops = MoeOperands(shape, dev, g); act = get_act_and_mul("silu")
CANDS = []
rows = []
for m in (16, 256, 1024, 4096):
    x = torch.randn(m, shape["hidden"], device=dev, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, shape["experts"], device=dev, generator=g)
    weights, ids = select_experts(logits, shape["top_k"], True)
    ref = fused_experts_int4_reference(x, *ops.int4["w13"], *ops.int4["w2"], 128, weights, ids, act)
    touched = torch.unique(ids).numel() / shape["experts"]
    def run(mod, i, tiles):
        ids_i = (ids + i * shape["top_k"]) % shape["experts"]
        return lambda: mod.fused_experts_int4(x, *ops.int4["w13"], *ops.int4["w2"], 128, weights, ids_i, act, tiles=tiles)
    bf16 = device_us(lambda i: (lambda ids_i=(ids + i * shape["top_k"]) % shape["experts"]: fused_experts(x, ops.bf16["w13"], ops.bf16["w2"], weights, ids_i, act)), int(ops.nbytes["bf16"] * touched), dev, 20)
    cell = {"tokens": m, "bf16": bf16}
    for tag, mod in (("base", B), ("new", NEW)):
        cands = [None] if tag == "base" else [None] + [(bm, *c) for bm in (32, 64, 128) if bm <= max(32, 4 * m * 8 // 128) for c in CANDS]
        for t in cands:
            tiles = None if t is None else (t, t)
            try:
                err = rel(run(mod, 0, tiles)().float(), ref.float())
                us = device_us(lambda i: run(mod, i, tiles), int(ops.nbytes["int4"] * touched), dev, 20)
            except Exception as e:
                print(f"  {tag} {t}: {type(e).__name__} {str(e)[:150]}", flush=True); continue
            cell[f"{tag} {t}"] = (us, err)
    newc = {k: v for k, v in cell.items() if k.startswith("new (")}
    best = min(newc, key=lambda k: newc[k][0]) if newc else None
    rows.append(cell)
    b, n = cell["base None"], cell["new None"]
    print(f"tokens {m:5d} | bf16 {bf16:8.1f} | base {b[0]:8.1f} ({bf16/b[0]:.2f}x, rel {b[1]:.1e}) | new default {n[0]:8.1f} ({bf16/n[0]:.2f}x, rel {n[1]:.1e}) ", flush=True)
    for k in sorted(newc, key=lambda k: newc[k][0])[:5]:
        print(f"      {k} {newc[k][0]:.1f}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "int4_moe.json"), "w"), indent=1, default=str)

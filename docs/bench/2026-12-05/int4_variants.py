"""Experiment: the INT4 GEMM's weight tile converted three ways, 7B layers, 16-256 rows, against bf16 cuBLAS.
base: fp32 codes - zero -> bf16 -> bf16 dot (the package's); tf32: fp32 codes - zero straight into a tf32 dot (x
widened to fp32), no float conversion of the weights; bf16m: codes | 0x4300 as bf16 (128 + code) minus 128 + zero
in bf16."""
import inspect, os, sys, importlib.util, itertools, json
sys.path.insert(0, os.getcwd())
import torch, triton
from novainfer.kernels import int4_gemm as i4
from benchmarks.quant_gpu import SHAPES_7B, Operands, device_us, rel
from novainfer.layers.quantization.int4 import dequantize_int4

src = inspect.getsource(i4._int4_gemm_kernel.fn)
src = src[src.index("@triton.jit"):]
LINE = "        acc += tl.dot((codes - zoff[:, None]).to(xt.dtype), xt) * s[:, None]\n"
assert LINE in src
variants = {
    "tf32": LINE.replace("tl.dot((codes - zoff[:, None]).to(xt.dtype), xt)", 'tl.dot(codes - zoff[:, None], xt.to(tl.float32), input_precision="tf32")'),
}
CODES = "        codes = tl.reshape(((q >> shifts) & 0xF) | MAGIC, [BLOCK_N, BLOCK_K]).to(tl.float32, bitcast=True)\n"
assert CODES in src
ZOFF = "        zoff = tl.load(z_ptr + sz_col + g).to(tl.float32) + 8388608.0\n"
assert ZOFF in src
mod_src = ["import triton\nimport triton.language as tl\nfrom novainfer.kernels.int4_gemm import MAGIC\nfrom novainfer.kernels.tiling import grouped_tile\n"]
for name, line in variants.items():
    mod_src.append(src.replace("def _int4_gemm_kernel", f"def k_{name}").replace(LINE, line))
b = src.replace("def _int4_gemm_kernel", "def k_bf16m")
b = b.replace(CODES, "        codes = tl.reshape((((q >> shifts) & 0xF) | 0x4300).to(tl.int16), [BLOCK_N, BLOCK_K]).to(tl.bfloat16, bitcast=True)\n")
b = b.replace(ZOFF, "        zoff = (tl.load(z_ptr + sz_col + g).to(tl.float32) + 128.0).to(tl.bfloat16)\n")
b = b.replace(LINE, "        acc += tl.dot(codes - zoff[:, None], xt) * s[:, None]\n")
mod_src.append(b)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_int4_var_kernels.py")
open(path, "w").write("\n\n".join(mod_src))
spec = importlib.util.spec_from_file_location("_int4_var_kernels", path)
V = importlib.util.module_from_spec(spec); spec.loader.exec_module(V)
kernels = {"base": i4._int4_gemm_kernel, "tf32": V.k_tf32, "bf16m": V.k_bf16m}


def gemm(kernel, x, q, s, z, tiles):
    m, k = x.shape; n = q.shape[0]
    bm, bn, bk, w, st = tiles
    tiles_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, per = i4.split_k(k, tiles_mn, bk, x.device, programs_per_sm=1)
    out = torch.zeros((m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    kernel[(tiles_mn, split)](x, q, s, z, out, m, n, k, q.stride(0), x.stride(0), out.stride(0), per, GROUP=128,
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT=split, num_warps=w, num_stages=st)
    return out


TILES = {16: [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 64, 4, 5)],
         64: [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (32, 128, 128, 4, 4)],
         128: [(64, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4)],
         256: [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 8, 3)]}
dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
rows = []
print("| layer | M | bf16 us | dequant+cuBLAS | " + " | ".join(f"{v} best (tile)" for v in kernels) + " |", flush=True)
for name, k, n in SHAPES_7B:
    ops = Operands(k, n, dev, g)
    ref = dequantize_int4(ops.q4, ops.s4.float(), ops.z4, 128)
    for m in (16, 64, 128, 256):
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        want = x.float() @ ref
        bf16 = device_us(lambda i: lambda w=ops.copy("bf16", i)[0]: torch.nn.functional.linear(x, w), 2 * n * k, dev, 20)
        deq = device_us(lambda i: lambda: torch.nn.functional.linear(x, i4.int4_dequantize(*ops.copy("int4", i), 128, x.dtype)), 2 * n * k, dev, 20)
        cell = {"layer": name, "m": m, "bf16": bf16, "dequant": deq}
        for vn, kern in kernels.items():
            best = None
            for t in TILES[m]:
                try:
                    err = rel(gemm(kern, x, *ops.copy("int4", 0), t).float(), want)
                    us = device_us(lambda i, t=t: lambda: gemm(kern, x, *ops.copy("int4", i), t), ops.q4.numel() * 4, dev, 20)
                except Exception as e:
                    print(f"  {vn} {t}: {type(e).__name__} {str(e)[:150]}", flush=True); continue
                cell[f"{vn} {t}"] = (us, err)
                if err > 1e-2:
                    print(f"  {vn} {t}: rel err {err:.1e}", flush=True)
                if best is None or us < best[0]:
                    best = (us, t, err)
            cell[vn] = best
        rows.append(cell)
        print(f"| {name} | {m} | {bf16:.1f} | {deq:.1f} ({bf16/deq:.2f}x) | " + " | ".join(
            f"{cell[v][0]:.1f} ({bf16/cell[v][0]:.2f}x) {cell[v][1]} e{cell[v][2]:.0e}" if cell[v] else "-" for v in kernels) + " |", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(os.path.join(out, "int4_variants.json"), "w"), indent=1, default=str)

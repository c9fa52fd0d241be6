"""Lab: does programmatic dependent launch (PDL) shorten a batch-1 chain of GEMVs on Hopper?

A chain of one-row GEMVs with the Qwen3.5-9B (or Qwen2.5-7B) decode stack's shapes, each reading the one before's
output, captured in one CUDA graph, in four forms of the same plain GEMV kernel:
  0 normal launches;
  1 PDL: each program triggers its dependents at once and waits for the kernel before it before any load;
  2 PDL, and the first weight tile is loaded before the wait (weights do not depend on the kernel before);
  3 PDL, and the first PF 128-byte lines of each weight row are prefetched into L2 before the wait.
Every form must give form 0's bits (the intermediates are zeroed before each checked replay, so a read before the
wait would show). Prints us a chain and weight TB/s per form.

    python3 pdl_gemv.py [--layers 16]
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise(
        "mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, K, MODE: tl.constexpr, PF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = 0
    if MODE >= 1:
        gdc_launch_dependents()
    if MODE == 1:
        gdc_wait()
    if MODE == 2:
        w0 = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_first")
        gdc_wait()
        x0 = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc += w0.to(tl.float32) * x0[None, :]
        k_start = BLOCK_K
    if MODE == 3:
        lines = tl.arange(0, PF) * 64
        _prefetch_l2(w_rows + tl.minimum(lines, K - 1)[None, :])
        gdc_wait()
    for k0 in range(k_start, K, BLOCK_K):
        offs = k0 + kk
        kmask = offs < K
        xf = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * xf[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=rmask)


SHAPES = {  # (N, K, (BLOCK_N, BLOCK_K, warps, stages)) a layer, from kernels/gemv.py's GEMV_TILES
    "qwen3.5-9b": [
        (12352, 4096, (8, 256, 2, 1)),
        (4096, 4096, (8, 1024, 2, 3)),
        (24576, 4096, (8, 512, 2, 3)),
        (4096, 12288, (1, 1024, 4, 3)),
    ],
    "qwen2.5-7b": [
        (4608, 3584, (4, 512, 4, 3)),
        (3584, 3584, (2, 512, 2, 3)),
        (37888, 3584, (2, 512, 2, 3)),
        (3584, 18944, (2, 2048, 2, 3)),
    ],
}


def build(shape: str, layers: int):
    torch.manual_seed(0)
    steps = []
    for _ in range(layers):
        for n, k, tiles in SHAPES[shape]:
            w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
            steps.append((w, torch.zeros(n, device="cuda", dtype=torch.bfloat16), tiles))
    x0 = torch.randn(SHAPES[shape][0][1], device="cuda", dtype=torch.bfloat16)
    return x0, steps


def chain(x0, steps, mode, pf):
    """Each GEMV reads the first K entries of the previous output."""
    x = x0
    for w, out, (bn, bk, warps, stages) in steps:
        n, k = w.shape
        gemv_kernel[(triton.cdiv(n, bn),)](
            x[:k],
            w,
            out,
            n,
            k,
            MODE=mode,
            PF=pf,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=warps,
            num_stages=stages,
            launch_pdl=mode >= 1,
        )
        x = out
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for shape in args.shapes:
        x0, steps = build(shape, args.layers)
        nbytes = sum(w.numel() * 2 for w, _, _ in steps)
        ref = chain(x0, steps, 0, 1).clone()
        torch.cuda.synchronize()
        rows = []
        for mode, pf in [(0, 1), (1, 1), (2, 1), (3, 4), (3, 16), (0, 1)]:
            try:
                chain(x0, steps, mode, pf)  # compile
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = chain(x0, steps, mode, pf)
                ok = True
                for _ in range(3):
                    for _, o, _ in steps:
                        o.zero_()
                    g.replay()
                    torch.cuda.synchronize()
                    ok &= torch.equal(out, ref)
                for _ in range(3):
                    g.replay()
                times = []
                for _ in range(5):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(args.iters):
                        g.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3 / args.iters)
                t = min(times)
                rows.append((mode, pf, t, nbytes / t / 1e6, ok, sorted(times)[2]))
                del g
            except Exception as e:  # a form that does not compile here says so and the rest go on
                rows.append((mode, pf, float("nan"), float("nan"), f"error {type(e).__name__}: {str(e)[:200]}", 0))
        print(f"\n{shape}: {args.layers} layers, {len(steps)} GEMVs, {nbytes / 1e9:.2f} GB of weights")
        print("| form | PF lines | us a chain (best of 5) | median | TB/s | us a GEMV | same bits as form 0 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for mode, pf, t, tbs, ok, med in rows:
            print(f"| {mode} | {pf} | {t:.1f} | {med:.1f} | {tbs:.3f} | {t / len(steps):.2f} | {ok} |")
        del steps, x0
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

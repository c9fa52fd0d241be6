"""The quantized CPU GEMM (kernels/cpu/qgemm.py) on the default model's real layers (its GGUF weights, kept
quantized), at given activation-row counts and thread counts. To compare commits, run it from two checkouts
(benchmarks/tree_ab.py does so in turns).

    python benchmarks/tuning/qgemm_rows.py --rows 1 5 16 --threads 1 2 --repeats 9

prints per layer and row count the median microseconds (the weight in cache after the first call), and a
whole-step estimate (every decoder layer's GEMMs plus the lm_head). The GEMM is compute-bound past one row, so
the row counts of a speculative verify step (k + 1) and of 16 streams are what this measures.

    python benchmarks/tuning/qgemm_rows.py --step --rows 1 --repeats 15

--step times a decode step's GEMMs as the model runs them: every packed weight once, in layer order, then the
lm_head (~100 MB streamed from memory, where the per-layer timings find the weight in cache), and prints the
packed bytes a step reads.

    python benchmarks/tuning/qgemm_rows.py --crossover --rows 4 8 12 16 24 32

--crossover times a decode step's GEMMs at each row count with the few-row kernel and with the panel kernel,
interleaved, and checks they give the same bits: where the panel one wins is qgemm.PANEL_MIN_ROWS.

    python benchmarks/tuning/qgemm_rows.py --prefill --rows 64 512 2048   # panel GEMM vs dequantize + BLAS sgemm

--prefill times, per decoder layer shape, the panel GEMM (csrc/qgemm_panel_cpu.c) against the weight dequantized
to float32 then torch's sgemm, interleaved, in GFLOPS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from novainfer.kernels.cpu import library, qgemm  # noqa: E402


def model_layers() -> dict[str, tuple]:
    """One packed weight of each kind in the default model (layer 0's, the lm_head), with how many per step."""
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.default_model import default_model_path
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = default_model_path()
    cfg = load_hf_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    layers, counts = {}, {}
    for name, module in model.named_modules():
        packed = getattr(getattr(module, "weight", None), "packed", None)
        if packed is None or name.endswith("embed_tokens"):
            continue
        key = name.split(".")[-1] if "layers." in name else "lm_head"
        counts[key] = counts.get(key, 0) + 1
        layers.setdefault(key, packed)
    if "lm_head" not in layers:  # tied: the embedding's packed weight serves as the lm_head
        layers["lm_head"], counts["lm_head"] = model.model.embed_tokens.weight.packed, 1
    return {k: (w, counts[k]) for k, w in layers.items()}


def time_us(fn, repeats: int, inner: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t) / inner * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7, help="rounds; the median is reported")
    ap.add_argument("--prefill", action="store_true", help="panel GEMM vs dequantize + sgemm (see above)")
    ap.add_argument("--step", action="store_true", help="a whole decode step's GEMMs, weights streamed (see above)")
    ap.add_argument("--crossover", action="store_true", help="few-row vs panel kernel per row count (see above)")
    args = ap.parse_args()
    if not library.available():
        raise SystemExit("the quantized CPU kernels are not available on this machine")
    if args.prefill:
        return prefill(args)
    if args.step:
        return decode_step(args)
    if args.crossover:
        return crossover(args)
    layers = model_layers()
    print("layers: " + ", ".join(f"{k} {w.kind} {w.shape[0]}x{w.shape[1]} (x{c})" for k, (w, c) in layers.items()))
    for threads in args.threads:
        library.set_num_threads(threads)
        print(f"\nthreads {threads}: median us")
        print(f"{'layer':>10} " + " ".join(f"{'M=' + str(m):>10}" for m in args.rows))
        step = dict.fromkeys(args.rows, 0.0)
        for key, (w, count) in layers.items():
            cells = []
            for m in args.rows:
                x = torch.randn(m, w.shape[1])
                inner = max(3, int(2e7 / (w.shape[0] * w.shape[1] * m)))
                med = statistics.median(time_us(lambda: qgemm.quant_gemm(x, w), args.repeats, inner))
                step[m] += med * count
                cells.append(f"{med:10.1f}")
            print(f"{key:>10} " + " ".join(cells))
        print(f"{'step ms':>10} " + " ".join(f"{step[m] / 1e3:10.2f}" for m in args.rows))
        print(f"{'ms/row':>10} " + " ".join(f"{step[m] / 1e3 / m:10.2f}" for m in args.rows))
    library.set_num_threads(None)


def step_weights() -> list:
    """Every packed weight of the default model in the order a decode step reads it (the tied lm_head last)."""
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.default_model import default_model_path
    from novainfer.loader.model_loader import load_hf_config, load_model

    path = default_model_path()
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig())
    out = []
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            out.append(lin.weight.packed)
    return out + [model.lm_head.weight.packed]


def decode_step(args: argparse.Namespace) -> None:
    """A decode step's GEMMs with the weights streamed (every packed weight once, in layer order)."""
    weights = step_weights()
    nbytes = sum(t.nbytes for w in weights for t in (w.qweight, w.scales, w.zeros) if t is not None) / 1e6
    print(f"packed bytes a step reads: {nbytes:.1f} MB")
    for m in args.rows:
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        for threads in args.threads:
            library.set_num_threads(threads)
            res = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                for x, w in zip(xs, weights):
                    qgemm.quant_gemm(x, w)
                res.append((time.perf_counter() - t) * 1e3)
            med = statistics.median(res)
            print(
                f"M={m} threads {threads}: ms a step, median {med:.2f} (min {min(res):.2f}); "
                f"{nbytes / med:.1f} GB/s of packed weights at the median"
            )
    library.set_num_threads(None)


def crossover(args: argparse.Namespace) -> None:
    """A decode step's GEMMs at each row count: the few-row kernel against the panel kernel, interleaved."""
    weights = step_weights()
    qgemm.set_panel_min_rows(2**31 - 1)  # panel=False: the few-row kernel at any row count
    for threads in args.threads:
        library.set_num_threads(threads)
        for m in args.rows:
            xs = [torch.randn(m, w.shape[1]) for w in weights]
            same = all(
                torch.equal(qgemm.quant_gemm(x, w, panel=False), qgemm.quant_gemm(x, w, panel=True))
                for x, w in zip(xs, weights)
            )
            res = {False: [], True: []}
            for _ in range(args.repeats):
                for panel in res:
                    t = time.perf_counter()
                    for x, w in zip(xs, weights):
                        qgemm.quant_gemm(x, w, panel=panel)
                    res[panel].append((time.perf_counter() - t) * 1e3)
            few, pan = statistics.median(res[False]), statistics.median(res[True])
            print(
                f"M={m} threads {threads}: ms a step, median few-row {few:.2f}, panel {pan:.2f} "
                f"(panel/few {pan / few:.2f}); same bits: {same}"
            )
    library.set_num_threads(None)
    qgemm.set_panel_min_rows(qgemm.PANEL_MIN_ROWS)


def prefill(args: argparse.Namespace) -> None:
    """Each decoder layer shape at each row count: the panel GEMM against dequantize + torch sgemm."""
    import torch.nn.functional as F

    layers = {k: v for k, v in model_layers().items() if k != "lm_head"}  # a prefill's lm_head sees one row
    torch_threads = torch.get_num_threads()
    for threads in args.threads:
        library.set_num_threads(threads)
        torch.set_num_threads(threads)
        print(f"\nthreads {threads}: median ms, dequantize + sgemm / panel GEMM (GFLOPS), speed-up")
        for m in args.rows:
            total = {"sgemm": 0.0, "panel": 0.0}
            for key, (w, count) in layers.items():
                x = torch.randn(m, w.shape[1])
                fns = {
                    "sgemm": lambda: F.linear(x, qgemm.dequantize(w)),
                    "panel": lambda: qgemm.quant_gemm(x, w, panel=True),
                }
                inner = max(1, int(5e8 / (w.shape[0] * w.shape[1] * m)))
                res = {k: [] for k in fns}
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        res[name] += time_us(fn, 1, inner)
                med = {k: statistics.median(v) / 1e3 for k, v in res.items()}
                flop = 2 * m * w.shape[0] * w.shape[1]
                for k in total:
                    total[k] += med[k] * count
                gf = {k: flop / v / 1e6 for k, v in med.items()}
                print(
                    f"M={m:5} {key:>8} {w.shape[0]}x{w.shape[1]}: {med['sgemm']:7.2f} ({gf['sgemm']:4.0f}) / "
                    f"{med['panel']:7.2f} ({gf['panel']:4.0f})  {med['sgemm'] / med['panel']:.2f}x"
                )
            print(
                f"M={m:5} all layers: {total['sgemm']:.1f} / {total['panel']:.1f} ms "
                f"({total['sgemm'] / total['panel']:.2f}x)"
            )
    library.set_num_threads(None)
    torch.set_num_threads(torch_threads)


if __name__ == "__main__":
    main()

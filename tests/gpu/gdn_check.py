"""The Gated DeltaNet kernels (novainfer/kernels/gated_delta_rule.py) on a GPU, on the DeltaNet shapes of
Qwen3.5-9B and Qwen3-Next-80B-A3B (linear_num_key_heads 16, linear_num_value_heads 32, key/value head dim 128,
conv width 4): our Triton kernels against the module's torch reference (run on the GPU in fp32 math) in bf16 and
fp32, and, when `fla` (fla-core) imports, fla's chunk_gated_delta_rule / fused_recurrent_gated_delta_rule against
the same reference; the time of each (triton.testing.do_bench, median) for decode batches 1/64/256 and prefill
1x8192 / 8x2048 tokens. Prints one table and exits non-zero when a check fails.

Needs only torch and triton (the kernel module is loaded by file path; novainfer itself is not imported); fla is
imported if installed, else from the wheels in .whl/ (fla-core, einops: pure Python) when they are there:
    python3 tests/gpu/gdn_check.py
fla's rows are held to the bf16 tolerance in fp32 too (its chunked kernels use TF32 matmuls).
`--smoke` runs the same checks on tiny shapes on the CPU (Triton interpreted) to try the script without a GPU.
"""

from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile

import torch

HK, HV, K, V, WIDTH = 16, 32, 128, 128, 4  # the linear-attention layers of Qwen3.5-9B and Qwen3-Next-80B-A3B
DEV = "cuda"
FLA_TOL = 2e-2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
rows: list[tuple[str, str, str, str, str, bool]] = []


def load_kernels():
    path = os.path.join(ROOT, "novainfer", "kernels", "gated_delta_rule.py")
    spec = importlib.util.spec_from_file_location("gated_delta_rule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_fla_wheels() -> None:
    """When fla is not installed, the wheels in .whl/ (fla-core, einops: pure Python) unpacked into a temporary
    folder on sys.path (also used by tests/gpu/qwen35_checks.py)."""
    try:
        import fla  # noqa: F401
    except ImportError:
        wheels = glob.glob(os.path.join(ROOT, ".whl", "*.whl"))
        if wheels:
            target = tempfile.mkdtemp(prefix="gdn_check_wheels_")
            atexit.register(shutil.rmtree, target, True)
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(target)
            sys.path.insert(0, target)


def load_fla():
    """fla's two entry points, or None (fla installed, or imported from the wheels in .whl/)."""
    add_fla_wheels()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure only means "no fla rows"
        print(f"fla not available ({type(exc).__name__}: {exc}); comparing against the torch reference only")
        return None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-20)).item()


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def record(case: str, impl: str, ms: float | None, err_o: float | None, err_s: float | None, tol: float) -> None:
    ok = all(e is None or e < tol for e in (err_o, err_s))
    rows.append((case, impl, fmt(ms, ".3f"), fmt(err_o, ".2e"), fmt(err_s, ".2e"), ok))
    print(
        ("PASS " if ok else "FAIL ") + f"{case} {impl}: {fmt(ms, '.3f')} ms, err o {fmt(err_o, '.2e')}, "
        f"err state {fmt(err_s, '.2e')} (tol {tol:g})",
        flush=True,
    )


def conv_dim() -> int:
    return 2 * HK * K + HV * V


def inputs(tokens: int, dtype: torch.dtype, gen: torch.Generator):
    """q, k [T, HK, K] and v [T, HV, V] as strided slices of one packed tensor (as the model's conv output is),
    g <= 0 in fp32, beta in (0, 1) in the activation dtype."""
    mixed = torch.randn(tokens, conv_dim(), device=DEV, generator=gen).to(dtype)
    q, k, v = mixed.split([HK * K, HK * K, HV * V], dim=1)
    q, k, v = q.view(tokens, HK, K), k.view(tokens, HK, K), v.view(tokens, HV, V)
    g = -torch.nn.functional.softplus(torch.randn(tokens, HV, device=DEV, generator=gen)) * 0.3
    beta = torch.sigmoid(torch.randn(tokens, HV, device=DEV, generator=gen)).to(dtype)
    return q, k, v, g, beta


def pool_and_slots(seqs: int, gen: torch.Generator):
    """A state pool with three spare slots and the sequences' slots in shuffled order."""
    slots = torch.randperm(seqs + 3, device=DEV, generator=gen)[:seqs].int()
    return torch.randn(seqs + 3, HV, K, V, device=DEV, generator=gen) * 0.05, slots


def conv_inputs(tokens: int, seqs: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(tokens, conv_dim(), device=DEV, generator=gen).to(dtype)
    weight = (torch.randn(conv_dim(), WIDTH, device=DEV, generator=gen) * 0.5).to(dtype)
    return x, weight, torch.randn(seqs + 3, WIDTH - 1, conv_dim(), device=DEV, generator=gen).to(dtype)


def tag(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def decode_case(gdr, fla, batch: int, dtype: torch.dtype, tol: float, time_it: bool) -> None:
    gen = torch.Generator(device=DEV).manual_seed(batch)
    q, k, v, g, beta = inputs(batch, dtype, gen)
    pool, slots = pool_and_slots(batch, gen)
    idx, name = slots.long(), f"decode B={batch} {tag(dtype)}"
    ref_pool, ours_pool = pool.clone(), pool.clone()
    ref = gdr.fused_recurrent_gated_delta_rule_torch(q, k, v, g, beta, ref_pool, slots)
    o = gdr.fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, ours_pool, slots)
    err_o, err_s = rel(o, ref), rel(ours_pool[idx], ref_pool[idx])
    ms = (
        bench(lambda: gdr.fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, ours_pool, slots))
        if time_it
        else None
    )
    record(name, "ours recurrent", ms, err_o, err_s, tol)
    if fla is not None:
        initial = pool[idx].clone()
        args = (q[:, None], k[:, None], v[:, None])  # g and beta by name: fla's 4th-6th parameters are g, gk, gv
        kw = {
            "g": g[:, None],
            "beta": beta[:, None],
            "initial_state": initial,
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": True,
        }
        fo, fh = fla[1](*args, **kw)
        ms = bench(lambda: fla[1](*args, **kw)) if time_it else None
        record(name, "fla fused_recurrent", ms, rel(fo[:, 0], ref), rel(fh, ref_pool[idx]), max(tol, FLA_TOL))
    x, weight, states = conv_inputs(batch, batch, dtype, gen)
    ref_states, ours_states = states.clone(), states.clone()
    ref = gdr.causal_conv1d_update_torch(x, weight, None, ref_states, slots)
    out = gdr.causal_conv1d_update_triton(x, weight, None, ours_states, slots)
    err_o, err_s = rel(out, ref), rel(ours_states[idx], ref_states[idx])
    ms = bench(lambda: gdr.causal_conv1d_update_triton(x, weight, None, ours_states, slots)) if time_it else None
    record(name, "ours conv1d_update", ms, err_o, err_s, tol)


def decode_tiles(gdr, batch: int = 256, smoke: bool = False) -> None:
    """The decode kernel's time per V-block width and warp count, for a float32 and a bfloat16 state pool
    (mamba_ssm_cache_dtype), bf16 activations: which tile the pool's bytes bind, and what halving them buys.
    smoke: one launch of the first tile per pool, untimed (the interpreter checks the launch's arguments)."""
    import triton

    gen = torch.Generator(device=DEV).manual_seed(7)
    q, k, v, g, beta = inputs(batch, torch.bfloat16, gen)
    pool, slots = pool_and_slots(batch, gen)
    print(f"\ndecode kernel tiles, B={batch}: ms (state GB/s)")
    for state_dtype in (torch.float32, torch.bfloat16):
        p = pool.to(state_dtype)
        row = []
        for bv in (16, 32, 64, 128):
            for warps in (1, 2, 4, 8):

                def launch():
                    gdr._recurrent_kernel[(batch * HV, triton.cdiv(V, bv))](
                        q, k, v, g, beta, torch.empty_like(v), p, slots, slots, g, g, K**-0.5, gdr.L2_EPS,
                        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
                        HK=HK, HV=HV, K=K, V=V, BK=K, BV=bv, VARLEN=False, L2NORM=True, RAW_GATES=False,
                        num_warps=warps,
                    )  # fmt: skip

                if smoke:
                    launch()
                    break
                ms = bench(launch)
                gbs = 2 * batch * HV * K * V * p.element_size() / ms / 1e6
                row.append(f"BV{bv}/w{warps} {ms:.3f} ({gbs:,.0f})")
            if smoke:
                break
        print(f"{tag(state_dtype)}: " + ", ".join(row), flush=True)


def prefill_case(gdr, fla, lens: list[int], dtype: torch.dtype, tol: float, time_it: bool) -> None:
    gen = torch.Generator(device=DEV).manual_seed(sum(lens))
    tokens, seqs = sum(lens), len(lens)
    q, k, v, g, beta = inputs(tokens, dtype, gen)
    pool, slots = pool_and_slots(seqs, gen)
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).int()
    idx, name = slots.long(), f"prefill {seqs}x{lens[0]} {tag(dtype)}"
    ref_pool = pool.clone()
    ref = gdr.chunk_gated_delta_rule_torch(q, k, v, g, beta, ref_pool, slots, cu)
    ref_h = ref_pool[idx]
    for impl, fn in (
        ("ours chunk", gdr.chunk_gated_delta_rule_triton),
        ("ours recurrent varlen", gdr.fused_recurrent_gated_delta_rule_triton),
    ):
        ours_pool = pool.clone()
        o = fn(q, k, v, g, beta, ours_pool, slots, cu)
        err_o, err_s = rel(o, ref), rel(ours_pool[idx], ref_h)
        ms = bench(lambda fn=fn, pool=ours_pool: fn(q, k, v, g, beta, pool, slots, cu)) if time_it else None
        record(name, impl, ms, err_o, err_s, tol)
    if fla is not None:
        args = (q[None], k[None], v[None])
        kw = {
            "g": g[None],
            "beta": beta[None],
            "initial_state": pool[idx].clone(),
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": True,
            "cu_seqlens": cu.long(),
        }
        fo, fh = fla[0](*args, **kw)
        ms = bench(lambda: fla[0](*args, **kw)) if time_it else None
        record(name, "fla chunk", ms, rel(fo[0], ref), rel(fh, ref_h), max(tol, FLA_TOL))
    x, weight, states = conv_inputs(tokens, seqs, dtype, gen)
    ref_states, ours_states = states.clone(), states.clone()
    ref = gdr.causal_conv1d_torch(x, weight, None, ref_states, slots, cu)
    out = gdr.causal_conv1d_triton(x, weight, None, ours_states, slots, cu)
    err_o, err_s = rel(out, ref), rel(ours_states[idx], ref_states[idx])
    ms = bench(lambda: gdr.causal_conv1d_triton(x, weight, None, ours_states, slots, cu)) if time_it else None
    record(name, "ours conv1d", ms, err_o, err_s, tol)


def report() -> None:
    print(f"\n{'case':<24} {'impl':<22} {'ms':>9} {'err o':>9} {'err state':>9}  ok")
    for case, impl, ms, eo, es, ok in rows:
        print(f"{case:<24} {impl:<22} {ms:>9} {eo:>9} {es:>9}  {'PASS' if ok else 'FAIL'}")
    failed = [r for r in rows if not r[-1]]
    print(
        f"\n{len(rows) - len(failed)}/{len(rows)} passed (err: max|x - ref| / max|ref|, ref = the torch reference "
        "in fp32 math; fla is timed without a slot gather/scatter, ours updates the pool in place)"
    )
    sys.exit(1 if failed else 0)


def main() -> None:
    global HK, HV, K, V, DEV
    if "--smoke" in sys.argv:
        os.environ["TRITON_INTERPRET"] = "1"
        HK, HV, K, V, DEV = 1, 2, 16, 32, "cpu"
        gdr = load_kernels()
        decode_case(gdr, None, 3, torch.float32, 1e-4, time_it=False)
        prefill_case(gdr, None, [70, 5], torch.float32, 1e-4, time_it=False)
        decode_tiles(gdr, batch=3, smoke=True)
        report()
    if not torch.cuda.is_available():
        sys.exit("gdn_check needs a CUDA GPU (or --smoke)")
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the torch reference (matmuls, the conv) in full fp32
    torch.backends.cudnn.allow_tf32 = False
    gdr, fla = load_kernels(), load_fla()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    # fp32: tight agreement (the chunked kernels' dots run in IEEE fp32); small shapes, untimed
    decode_case(gdr, fla, 8, torch.float32, 1e-4, time_it=False)
    prefill_case(gdr, fla, [300, 64, 1], torch.float32, 1e-4, time_it=False)
    # bf16 activations (the models' dtype) with the fp32 state; tf32 dots in the chunked kernels
    for batch in (1, 64, 256):
        decode_case(gdr, fla, batch, torch.bfloat16, FLA_TOL, time_it=True)
    decode_tiles(gdr)
    if "--tiles-only" in sys.argv:
        return
    for lens in ([8192], [2048] * 8):
        prefill_case(gdr, fla, lens, torch.bfloat16, FLA_TOL, time_it=True)
    report()


if __name__ == "__main__":
    main()

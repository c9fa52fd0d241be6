"""SASS instructions a weight in the INT4 GEMV's main loop, compiled for sm_90 on a machine without a GPU (Triton's
bundled ptxas and nvdisasm): the count the pair form was built to lower.

    python docs/bench/2026-12-05/s12/sass_count.py novainfer/kernels/int4_gemm.py
    python docs/bench/2026-12-05/s12/sass_count.py docs/bench/2026-12-05/s12/int4_gemm_pair_form.py
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tests.sm90_ptx import ALIGNED, INT4  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def sass(fn, constexprs: dict, warps: int, stages: int) -> str:
    sig = {n: "constexpr" if n in constexprs else INT4.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t[0] == "*" or n in ALIGNED}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([f"{BIN}/nvdisasm", "-c", f.name], capture_output=True, text=True, check=True).stdout


def main_loop(text: str) -> collections.Counter:
    """Opcodes from the label to the backward branch of the longest loop."""
    pos, ins, best = {}, [], collections.Counter()
    for line in text.splitlines():
        if m := re.match(r"\s*\.L_x_(\d+):", line):
            pos[m.group(1)] = len(ins)
        elif m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            ins.append(m.group(1).strip())
    for i, s in enumerate(ins):
        if (m := re.search(r"BRA.*\.L_x_(\d+)", s)) and pos.get(m.group(1), i + 1) <= i:
            body = ins[pos[m.group(1)] : i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)
            best = max(best, ops, key=lambda c: sum(c.values()))
    return best


def main() -> None:
    spec = importlib.util.spec_from_file_location("kernel_under_count", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = mod._int4_gemv_kernel
    for m in (1, 2, 4):
        for bn, bk, warps, stages in mod.GEMV_CANDIDATES:
            consts = {"M": m, "GROUP": 128, "BLOCK_N": bn, "BLOCK_K": bk}
            if "EVEN_K" in fn.arg_names:
                consts["EVEN_K"] = True
            ops = main_loop(sass(fn, consts, warps, stages))
            per_thread = bn * bk / (warps * 32)  # weights a thread takes a loop step
            print(
                f"M={m} tile {(bn, bk, warps, stages)}: rows a thread {bn * bk / (1024 * warps):g}, "
                f"{sum(ops.values()) / per_thread:.2f} instructions a weight, spills {'STL' in ops}, "
                f"{dict(ops.most_common(6))}"
            )


if __name__ == "__main__":
    main()

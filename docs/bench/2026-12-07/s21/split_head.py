"""The LM head (q6, 208 MB) in one GEMV call against the same bytes in pieces of a body layer's size (lab)."""

import os
import sys
import time
import statistics
import dataclasses
import torch
import gc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from torch import nn
from novainfer import LLM
from novainfer.kernels.cpu import qgemm
from novainfer.kernels.cpu.decoder_stack import packed_weight

llm = LLM(sys.argv[1])
model = next(o for o in gc.get_objects() if isinstance(o, nn.Module) and type(o).__name__.endswith("ForCausalLM"))
head = packed_weight(model.lm_head)
P = head.qweight.shape[0]
x = torch.randn(1, head.shape[1])
nb = sum(t.nbytes for t in (head.qweight, head.scales, head.zeros) if t is not None)


def pieces(rows):
    p = rows // 16
    out = []
    for p0 in range(0, P, p):
        p1 = min(P, p0 + p)
        out.append(
            dataclasses.replace(
                head,
                qweight=head.qweight[p0:p1],
                scales=head.scales[p0:p1],
                zeros=None if head.zeros is None else head.zeros[p0:p1],
                shape=(16 * (p1 - p0), head.shape[1]),
            )
        )
    return out


for rows in (P * 16, 65536, 16384, 7168, 2048, 1024):
    ws = pieces(rows)
    res = []
    for _ in range(7):
        t = time.perf_counter()
        for w in ws:
            qgemm.quant_gemm(x, w)
        res.append(time.perf_counter() - t)
    m = statistics.median(res)
    print(
        f"pieces of {rows:6d} rows ({nb / len(ws) / 1e6:6.2f} MB) x{len(ws):4d}: {m * 1e3:.2f} ms, {nb / m / 1e9:.1f} GB/s, {m / len(ws) * 1e6:.1f} us a call"
    )

"""Lab (session 21): a Qwen3.5-0.8B Q4_K_M 512-token prefill split into the linear layers, the DeltaNet C prefill, the
gated norm and attention (wrappers around each entry point)."""

import os
import sys
import time
import collections
import random

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from novainfer import LLM, SamplingParams
from novainfer.kernels.cpu import gated_delta, ops
from novainfer.layers.quantization import gguf_cpu

acc = collections.defaultdict(float)
cnt = collections.Counter()


def wrap(obj, name, key):
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[key] += time.perf_counter() - t
        cnt[key] += 1
        return r

    setattr(obj, name, g)


wrap(gated_delta, "prefill", "gdn prefill (conv+rule)")
wrap(gated_delta, "gated_rms_norm", "gated_rms_norm")
wrap(gguf_cpu.GGUFCPULinearMethod, "apply", "linear apply")
for n in dir(ops):
    if n.startswith("prefill_attention"):
        wrap(ops, n, "attn " + n)
llm = LLM(sys.argv[1])


def run(n, plen):
    p = [random.randrange(1000, 200000) for _ in range(plen)]
    t = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    return time.perf_counter() - t


run(1, 512)
acc.clear()
cnt.clear()
T = run(1, 512)
print(f"prefill 512: {T * 1e3:.0f} ms")
for k in acc:
    print(f"{k:30s} {acc[k] * 1e3:.1f} ms  calls {cnt[k]}")

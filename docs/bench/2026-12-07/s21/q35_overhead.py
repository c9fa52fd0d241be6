"""Lab (session 21): the Python around each Qwen3.5 layer's C call, from wrappers around the layer forward and the C entry points."""

import os
import sys
import time
import collections
import random

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from novainfer import LLM, SamplingParams
from novainfer.kernels.cpu import gdn_layer, gated_attn_layer
from novainfer.models import llama, qwen3_5

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


class LibProxy:
    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, n):
        f = getattr(self._lib, n)
        if n in ("gdn_layer_decode", "gated_attn_layer_decode"):

            def g(*a):
                t = time.perf_counter()
                r = f(*a)
                acc["C:" + n] += time.perf_counter() - t
                cnt["C:" + n] += 1
                return r

            return g
        return f


for mod in (gdn_layer, gated_attn_layer):
    lib = mod._lib()
    proxy = LibProxy(lib)
    mod._lib = lambda p=proxy: p
wrap(qwen3_5.HybridDecoderLayer, "forward", "layer.forward")
for c in list(vars(qwen3_5).values()):
    pass

wrap(llama.LlamaModel, "forward", "model.forward")
llm = LLM(sys.argv[1])


def run(n):
    p = [random.randrange(1000, 200000) for _ in range(16)]
    t = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    return time.perf_counter() - t


run(8)
acc.clear()
cnt.clear()
T = run(129)
print(f"total {T / 128 * 1e3:.2f} ms/step")
for k in acc:
    print(f"{k:28s} {acc[k] * 1e3 / 128:.3f} ms/step  calls/step {cnt[k] / 129:.1f}")

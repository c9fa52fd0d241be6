"""Lab (session 21): a Gemma-4-E2B Q4_K_M decode step split into the C stack, the LM head and the rest; the packed
bytes a step reads; then cProfile over a short run."""

import os
import sys
import time
import collections
import random
import gc
import cProfile
import pstats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from torch import nn
from novainfer import LLM, SamplingParams
from novainfer.kernels.cpu import gemma4_stack
from novainfer.kernels.cpu.decoder_stack import packed_weight
from novainfer.models import llama, gemma4
from novainfer.worker import cpu_gemma4_stack

acc = collections.defaultdict(float)
cnt = collections.Counter()


def wrap(cls, name, key):
    f = getattr(cls, name)

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[key] += time.perf_counter() - t
        cnt[key] += 1
        return r

    setattr(cls, name, g)


wrap(gemma4_stack.Gemma4StackKernel, "run", "C stack")
wrap(cpu_gemma4_stack.CPUGemma4Stack, "forward", "stack.forward")
for mod in (llama, gemma4):
    for c in list(vars(mod).values()):
        if isinstance(c, type) and "compute_logits" in vars(c):
            wrap(c, "compute_logits", "logits:" + c.__name__)
llm = LLM(sys.argv[1])


def run(n):
    p = [random.randrange(1000, 200000) for _ in range(16)]
    t = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    return time.perf_counter() - t


run(4)
acc.clear()
cnt.clear()
T = run(65)
print(f"step {T / 64 * 1e3:.2f} ms")
for k in acc:
    print(f"{k:28s} {acc[k] * 1e3 / 64:.3f} ms/step  calls/step {cnt[k] / 65:.2f}")
model = next(o for o in gc.get_objects() if isinstance(o, nn.Module) and type(o).__name__.endswith("ForCausalLM"))
tot = collections.Counter()
for name, m in model.named_modules():
    w = packed_weight(m) if hasattr(m, "weight") else None
    if w is None:
        continue
    b = sum(t.nbytes for t in (w.qweight, w.scales, w.zeros) if t is not None)
    key = "lm_head" if "lm_head" in name else ("embed" if "embed" in name else "body")
    tot[key] += b
print({k: round(v / 1e6, 1) for k, v in tot.items()}, "MB")
pr = cProfile.Profile()
pr.enable()
run(33)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)

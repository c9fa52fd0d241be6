"""Lab (session 21): a Gemma-4-E2B Q4_K_M decode step split into the C stack, the LM head and the rest; the packed
bytes a step reads; then cProfile over a short run."""

import cProfile
import collections
import gc
import pstats
import sys

import labtime as lt
from torch import nn

from novainfer import LLM
from novainfer.kernels.cpu import gemma4_stack
from novainfer.kernels.cpu.decoder_stack import packed_weight
from novainfer.models import gemma4, llama
from novainfer.worker import cpu_gemma4_stack

lt.wrap(gemma4_stack.Gemma4StackKernel, "run", "C stack")
lt.wrap(cpu_gemma4_stack.CPUGemma4Stack, "forward", "stack.forward")
for mod in (llama, gemma4):
    for c in list(vars(mod).values()):
        if isinstance(c, type) and "compute_logits" in vars(c):
            lt.wrap(c, "compute_logits", "logits:" + c.__name__)
llm = LLM(sys.argv[1])
lt.generate_s(llm, 4)
lt.step_report(llm, 64)
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
lt.generate_s(llm, 33)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)

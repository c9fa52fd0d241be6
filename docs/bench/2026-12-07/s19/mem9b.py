"""GPU memory of a Qwen3.5-9B-shape engine (random weights, max_model_len 4096, the 16,384-token budget) after the
memory profile, after start-up, and after two 16,384-token prefill steps; which launch choices fell back for
shared memory, and whether this Triton re-raises one cached error object (the 12 GiB leak's suspected cause).
Run from a tree's root: python3 mem9b.py"""

import inspect
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.checkpoints import load_format, resolve_model  # noqa: E402
from novainfer import LLM, SamplingParams  # noqa: E402
import novainfer.worker.kv_cache as kc  # noqa: E402
import novainfer.worker.model_runner as mr  # noqa: E402

src = inspect.getsource(triton.compiler.compiler.CompiledKernel._init_handles)
print(f"triton {triton.__version__}: the cached launch error is {'cloned' if 'copy' in src else 'the same object'}")
GiB = 2**30
orig = kc.num_blocks_that_fit


def spy(*a, **k):
    n = orig(*a, **k)
    print(
        f"after profile: peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, "
        f"allocated {torch.cuda.memory_allocated() / GiB:.2f}, blocks {n}",
        flush=True,
    )
    return n


kc.num_blocks_that_fit = spy
mr.num_blocks_that_fit = spy
m = "random:qwen3.5-9b"
llm = LLM(
    resolve_model(m), load_format=load_format(m), max_model_len=4096, dtype="bfloat16", gpu_memory_utilization=0.9
)
print(f"after start-up: allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB", flush=True)
for step in range(2):
    torch.cuda.reset_peak_memory_stats()
    p = [{"prompt_token_ids": list(range(100 + i + step, 612 + i + step))} for i in range(32)]
    llm.generate(p, SamplingParams(max_tokens=1, temperature=0.6), use_tqdm=False)
    print(
        f"16,384-token step {step + 1}: peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, "
        f"allocated {torch.cuda.memory_allocated() / GiB:.2f}",
        flush=True,
    )
try:
    from novainfer.kernels import tiling

    print("launches that fell back:", sorted(map(str, tiling._unfit)) or "none")
except (ImportError, AttributeError):
    print("(this tree has no tiling._unfit)")

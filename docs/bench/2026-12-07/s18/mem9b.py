import sys, time, torch
sys.path.insert(0, ".")
from benchmarks.checkpoints import load_format, resolve_model
from novainfer import LLM, SamplingParams
import novainfer.worker.kv_cache as kc
orig = kc.num_blocks_that_fit
def spy(*a, **k):
    n = orig(*a, **k)
    free, total = torch.cuda.mem_get_info()
    print(f"after profile: max_alloc {torch.cuda.max_memory_allocated()/2**30:.2f} GiB, alloc {torch.cuda.memory_allocated()/2**30:.2f}, used {(total-free)/2**30:.2f}, blocks {n}", flush=True)
    return n
kc.num_blocks_that_fit = spy
import novainfer.worker.model_runner as mr; mr.num_blocks_that_fit = spy
m = "random:qwen3.5-9b"
llm = LLM(resolve_model(m), load_format=load_format(m), max_model_len=4096, dtype="bfloat16", gpu_memory_utilization=0.9)
free, total = torch.cuda.mem_get_info()
print(f"after init: alloc {torch.cuda.memory_allocated()/2**30:.2f} GiB, used {(total-free)/2**30:.2f}", flush=True)
torch.cuda.reset_peak_memory_stats()
p = [{"prompt_token_ids": list(range(100 + i, 612 + i))} for i in range(32)]
llm.generate(p, SamplingParams(max_tokens=1, temperature=0.6), use_tqdm=False)
print(f"one 16384-token step: peak {torch.cuda.max_memory_allocated()/2**30:.2f} GiB, alloc {torch.cuda.memory_allocated()/2**30:.2f}", flush=True)

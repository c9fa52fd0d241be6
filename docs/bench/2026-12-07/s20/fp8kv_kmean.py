"""Lab: an fp8 K cache holding k - mu, mu each layer's per-channel mean of K (post-rotary) over the float32 run.

q.(k - mu) differs from q.k by q.mu, the same for every key of a query, so softmax is unchanged: only the e4m3
rounding of the smaller k - mu differs. mu is taken from the reference run's own text (an upper bound on what a
calibration pass would give). SmolLM2-135M (30 layers), as fp8kv_rotation.py.

    PYTHONPATH=. python docs/bench/2026-12-07/s20/fp8kv_kmean.py k|kv
"""

import sys
import novainfer
import novainfer.attention.torch_backend as tb
from novainfer.kernels.kv_fp8 import to_fp8

QUANT = sys.argv.pop(1)
L = 30
store = tb.store_kv
state = {"run": 0, "calls": 0}
sums, counts = {}, {}


def rt(x, s):
    return (to_fp8(x.float(), s).float() * s).to(x.dtype)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    layer = state["calls"] % L
    state["calls"] += 1
    if state["run"] == 1:
        sums[layer] = sums.get(layer, 0) + key.float().sum(0)
        counts[layer] = counts.get(layer, 0) + key.shape[0]
    elif state["run"] == 2:
        mu = (sums[layer] / counts[layer]).to(key.dtype)
        if "k" in QUANT:
            key = rt(key - mu, k_scale) + mu
        if "v" in QUANT:
            value = rt(value, v_scale)
    return store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


tb.store_kv = store_kv
engine_llm = novainfer.LLM


def llm(*a, **k):
    state["run"] += 1
    state["calls"] = 0
    return engine_llm(*a, **{**k, "kv_cache_dtype": "float32"})


novainfer.LLM = llm
import benchmarks.kv_cache_accuracy as kca  # noqa: E402

kca.main()
for layer in (0, 5, 15, 29):
    mu = sums[layer] / counts[layer]
    print(layer, "mean |mu|", mu.abs().mean().item(), "max |mu|", mu.abs().max().item())

"""Lab: where does the fp8 KV cache's error come from? Fake quantization (a float32 cache holding e4m3-rounded
K/V, scale 1.0) with the first P positions of each window kept exact (the attention sink), K and V separately.
One window a step (max_num_seqs 1, the whole window one chunk), so the rows store_kv gets are positions 0..L-1."""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))

from kv_cache_accuracy import distributions, text_windows  # noqa: E402
from kv_smooth import compare  # noqa: E402  (also installs its patches, inert without a shift)

from novainfer import LLM  # noqa: E402
from novainfer.attention import torch_backend as tb  # noqa: E402
from novainfer.kernels.kv_fp8 import to_fp8  # noqa: E402
from novainfer.loader.default_model import default_model_path  # noqa: E402

inner_store = tb.store_kv
mode = {"p": None, "k": True, "v": True}


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    p = mode["p"]
    if p is not None:
        if mode["k"]:
            key = key.clone()
            key[p:] = to_fp8(key[p:], 1.0).to(key.dtype)
        if mode["v"]:
            value = value.clone()
            value[p:] = to_fp8(value[p:], 1.0).to(value.dtype)
    inner_store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


tb.store_kv = store_kv


def run(model, seqs, p, k=True, v=True):
    mode.update(p=p, k=k, v=v)
    llm = LLM(model, kv_cache_dtype="float32", device="cpu", dtype="float32", enable_prefix_caching=False,
              attention_backend="torch", max_num_seqs=1)  # fmt: skip
    d = distributions(llm, seqs, 20)
    llm.llm_engine.shutdown()
    return d


def main():
    model = default_model_path()
    probe = LLM(model, device="cpu", dtype="float32", attention_backend="torch")
    seqs = text_windows(probe.get_tokenizer(), int(os.environ.get("WINDOWS", 8)), 256)
    probe.llm_engine.shutdown()
    ref = run(model, seqs, None)
    print("| fake e4m3 | top-1 vs float32 KV | KL |")
    for name, p, k, v in [("K and V, all positions", 0, True, True), ("K and V, position 0 exact", 1, True, True),
                          ("K and V, positions 0-3 exact", 4, True, True), ("K only, all", 0, True, False),
                          ("V only, all", 0, False, True), ("K only, position 0 exact", 1, True, False)]:  # fmt: skip
        a, kl = compare(ref, run(model, seqs, p, k, v))
        print(f"| {name} | {a:.2%} | {kl:.5f} |", flush=True)


if __name__ == "__main__":
    main()

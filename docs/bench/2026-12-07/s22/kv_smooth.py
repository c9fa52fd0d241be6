"""Lab: does subtracting a fixed per-(layer, kv head, channel) mean from K and V before the fp8 (e4m3) cache lift
teacher-forced agreement? Both shifts are exact in real arithmetic: softmax(q.(k - mu)) = softmax(q.k) because
q.mu is one constant per query row, and sum_t p_t (v_t - nu) + nu = sum_t p_t v_t because the p_t sum to 1.
So only the rounding changes: e4m3's error scales with |k - mu| instead of |k|.

Modes (the default model, CPU torch backend, docs/*.md windows as benchmarks/kv_cache_accuracy.py):
  float32 (reference), bfloat16, fp8, fp8 with mu/nu measured on the same text (oracle), fp8 with mu/nu measured
  on other text (calibrated: the repository's Python sources).
"""

from __future__ import annotations

import glob
import math
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kv_cache_accuracy import distributions, text_windows  # noqa: E402

from novainfer import LLM  # noqa: E402
from novainfer.attention import torch_backend as tb  # noqa: E402
from novainfer.kernels.kv_fp8 import is_fp8  # noqa: E402
from novainfer.loader.default_model import default_model_path  # noqa: E402

orig_store, orig_attn = tb.store_kv, tb.paged_attention
state = {"layers": {}, "sums": None, "shift": None}


def layer_of(cache: torch.Tensor) -> int:
    return state["layers"].setdefault(cache.data_ptr(), len(state["layers"]))


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    li = layer_of(k_cache)
    if state["sums"] is not None:  # collecting: sums of K and V per layer
        s = state["sums"].setdefault(li, [0, 0.0, 0.0])
        s[0] += key.shape[0]
        s[1] = s[1] + key.double().sum(0)
        s[2] = s[2] + value.double().sum(0)
    if state["shift"] is not None and is_fp8(k_cache):
        mu, nu = state["shift"][li]
        key, value = key - mu.to(key.dtype), value - nu.to(value.dtype)
    orig_store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query, k_cache, v_cache, meta, scale, *a, **kw):
    out = orig_attn(query, k_cache, v_cache, meta, scale, *a, **kw)
    if state["shift"] is not None and is_fp8(k_cache):
        nu = state["shift"][layer_of(k_cache)][1]  # [kv_heads, d]
        group = query.shape[1] // nu.shape[0]
        out = out + nu.repeat_interleave(group, dim=0).to(out.dtype)
    return out


tb.store_kv, tb.paged_attention = store_kv, paged_attention


def run(model, kv, seqs, shift=None, collect=False):
    state["layers"], state["shift"] = {}, shift
    state["sums"] = {} if collect else None
    llm = LLM(
        model, kv_cache_dtype=kv, device="cpu", dtype="float32", enable_prefix_caching=False, attention_backend="torch"
    )
    d = distributions(llm, seqs, 20)
    sums = state["sums"]
    llm.llm_engine.shutdown()
    del llm
    if collect:
        return d, {li: (s[1] / s[0], s[2] / s[0]) for li, s in sums.items()}
    return d


def compare(ref, got):
    agree = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(ref, got)) / len(ref)
    kl = sum(sum(math.exp(lp) * (lp - b.get(t, min(b.values()))) for t, lp in a.items()) for a, b in zip(ref, got))
    return agree, kl / len(ref)


def main():
    model = default_model_path()
    windows, length = int(os.environ.get("WINDOWS", 8)), int(os.environ.get("LENGTH", 256))
    probe = LLM(model, device="cpu", dtype="float32", attention_backend="torch")
    llm_tok = probe.get_tokenizer()
    probe.llm_engine.shutdown()
    del probe
    seqs = text_windows(llm_tok, windows, length)
    code = "\n".join(open(p).read() for p in sorted(glob.glob(os.path.join(ROOT, "novainfer", "*", "*.py"))))
    ids = llm_tok.encode(code)
    calib = [ids[i : i + length] for i in range(0, 4 * length, length)]
    ref, oracle = run(model, "float32", seqs, collect=True)
    _, calibrated = run(model, "float32", calib, collect=True)
    zero = {li: (torch.zeros_like(m), torch.zeros_like(n)) for li, (m, n) in oracle.items()}
    mag = [(m.abs().mean().item(), n.abs().mean().item()) for m, n in oracle.values()]
    print("mean |mu|, |nu| per layer (first 6):", [(round(a, 2), round(b, 3)) for a, b in mag[:6]])
    bf = run(model, "bfloat16", seqs)
    rows = [("bfloat16", bf)]
    rows.append(("fp8", run(model, "fp8", seqs, shift=zero)))
    rows.append(("fp8 + oracle shift", run(model, "fp8", seqs, shift=oracle)))
    rows.append(("fp8 + calibrated shift", run(model, "fp8", seqs, shift=calibrated)))
    k_only = {li: (m, torch.zeros_like(n)) for li, (m, n) in calibrated.items()}
    rows.append(("fp8 + calibrated K shift only", run(model, "fp8", seqs, shift=k_only)))
    print(f"{len(ref)} positions ({windows} x {length} tokens of docs/*.md)")
    print("| KV | top-1 vs float32 KV | KL vs float32 | top-1 vs bf16 KV |")
    for name, d in rows:
        a, kl = compare(ref, d)
        b, _ = compare(bf, d)
        print(f"| {name} | {a:.2%} | {kl:.5f} | {b:.2%} |")


if __name__ == "__main__":
    main()

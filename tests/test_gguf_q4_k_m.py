"""A tiny qwen2-shape GGUF in llama.cpp's Q4_K_M mix (benchmarks/gguf_checkpoint.py, the writer of the 7B
benchmark): NovaInfer's default quantized path gives transformers' greedy tokens on it; the repack in row
chunks equals gguf's own dequantization; the loader repacks a layer as soon as its shards are in."""

import weakref

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from benchmarks.gguf_checkpoint import SHAPES, write_qwen2_q4_k_m
from novainfer.kernels.cpu import library, repack as gguf_repack

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
PROMPT = [1, 5, 9, 300, 7, 1500, 12]  # its first greedy token is a near-tie (0.03 apart)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_qwen2_q4_k_m(str(tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf"), SHAPES["tiny"])


def test_file_has_llama_cpp_q4_k_m_types(tiny_gguf):
    types = {t.name: T(t.tensor_type) for t in GGUFReader(tiny_gguf).tensors}
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    # two layers: use_more_bits picks layer 1 (i >= 7 * 2 // 8) for Q6_K attn_v / ffn_down
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 1)] == [T.Q4_K, T.Q6_K]
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1)] == [T.Q4_K, T.Q6_K]
    assert types["blk.0.attn_q.bias"] == T.F32 and types["blk.1.ffn_gate.weight"] == T.Q4_K


def test_greedy_tokens_match_transformers_on_the_same_file(tiny_gguf):
    from tests.hf_gguf import hf_model_from_gguf

    from novainfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy = {}
    for dtype in (None, "float32"):  # the defaults (GGUF blocks kept quantized, bf16 KV), the exact path
        llm = LLM(tiny_gguf, max_model_len=256, dtype=dtype)
        greedy[dtype] = list(
            llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
        )
        llm.llm_engine.shutdown()
    hf = hf_model_from_gguf(tiny_gguf)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0]
        logits = hf(torch.tensor([PROMPT + greedy[None]])).logits[0, len(PROMPT) - 1 : -1]
    assert greedy["float32"] == ref[len(PROMPT) :].tolist()
    # the default path's KV cache is bfloat16 (logits off by up to ~0.2 here, std 4), so on a near-tie it may
    # pick the runner-up: each of its tokens must be within 0.5 of transformers' best logit on its own prefix
    chosen = logits[torch.arange(12), torch.tensor(greedy[None])]
    assert (chosen >= logits.amax(-1) - 0.5).all(), (greedy[None], ref[len(PROMPT) :].tolist())
    assert (chosen == logits.amax(-1)).sum() >= 9  # and mostly the very best (near-ties are rare)


@pytest.mark.parametrize("qtype", sorted(gguf_repack.BLOCK, key=int), ids=lambda t: t.name)
def test_repack_in_row_chunks_is_exact(qtype, monkeypatch):
    from tests.test_quantized_cpu import random_blocks as format_blocks

    n, k = 7, 512
    blocks = format_blocks(qtype, n, k)
    per, nbytes = gguf_repack.BLOCK[qtype]
    monkeypatch.setattr(gguf_repack, "CHUNK_BYTES", 2 * (k // per) * nbytes)  # two rows a chunk; 7 rows: 4 chunks
    w = gguf_repack.repack(blocks, qtype, (n, k))
    ref = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(w.dequantize(), ref)


def test_loader_repacks_each_layer_as_its_shards_arrive(tiny_gguf, monkeypatch):
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader import gguf_loader
    from novainfer.loader.model_loader import load_hf_config, load_model

    read, most_alive = [], [0]
    real = gguf_loader._read_bytes

    def tracked(path, tensor):
        buf = real(path, tensor)
        read.append(weakref.ref(buf))
        most_alive[0] = max(most_alive[0], sum(r() is not None for r in read))
        return buf

    monkeypatch.setattr(gguf_loader, "_read_bytes", tracked)
    model = load_model(
        tiny_gguf, load_hf_config(tiny_gguf), torch.float32, torch.device("cpu"), quant_config=GGUFCPUConfig()
    )
    assert len(read) == 2 + 2 * 7  # every matrix came through _read_bytes
    assert most_alive[0] <= 3  # q, k, v of one layer at most; never the whole file's blocks
    assert all(r() is None for r in read)
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.weight.packed.kind == "q4"
    assert layers[1].self_attn.qkv_proj.weight.packed.kind == "q8"  # Q4_K q/k with a Q6_K v: groups of 16
    assert model.lm_head.weight.packed.group == 16


def test_gguf_7b_benchmark_runs_on_the_tiny_shape(tmp_path):
    """benchmarks/gguf_7b.py end to end on the tiny shape: both engines load the file and agree on it."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("llama_cpp")  # the comparison engine; not a dependency of the tests
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path, out = tmp_path / "tiny.gguf", tmp_path / "r.json"
    cmd = [
        sys.executable,
        os.path.join(root, "benchmarks", "gguf_7b.py"),
        "--shape",
        "tiny",
        "--path",
        str(path),
        "--repeat",
        "1",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--prefill-len",
        "32",
        "--agree-len",
        "16",
        "--delete",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert not path.exists()  # --delete
    for engine in ("novainfer", "llamacpp"):
        assert "error" not in r[engine], r[engine]
        # timings only: on a tiny model a 1-token run can outlast a 4-token one on a busy machine
        assert min(r[engine]["one_s"] + r[engine]["full_s"]) > 0 and r[engine]["peak_rss_polled_mb"] > 0
    assert r["agreement"]["n"] == 15 and r["agreement"]["top1"] >= 12 and r["agreement"]["in5"] >= 14

"""Run on a machine with an NVIDIA GPU: python3 tests/gpu/gpu_check.py

1. Triton kernels vs the torch reference on real shapes (Qwen2.5-0.5B and -7B heads), bf16: rel err <= 1e-2.
2. Engine greedy tokens vs transformers on the GPU in float32, first 32 tokens, CUDA graphs on.
3. CUDA-graph replay vs eager: identical tokens (bf16, a batch that spans several graph sizes).
4. Model families (tests/gpu/family_checks.py): the fused MoE kernel (Qwen3-30B-A3B, Qwen2-57B-A14B, Mixtral
   shapes) and sliding-window / soft-cap attention (Gemma-2-9B, Mistral-7B heads) in bf16 vs their torch
   references, rel err <= 1e-2; the new families' greedy tokens vs transformers in float32.
5. The overlapped step loop's tokens equal the synchronous loop's (and engine_vs_hf runs with it, the
   CUDA default).
6. Speculative decoding (n-gram and a draft model) gives the greedy tokens of decoding without it
   (float32) and transformers'; verify steps replayed from CUDA graphs give the tokens of eager verify steps
   (bf16), and the graphs are really replayed.
7. quantization="fp8" (tests/gpu/fp8_checks.py): the fp8 linear method on Qwen2.5-7B's layer shapes
   in bf16 against the float64 product of its dequantized operands (<= 1e-2) and the bf16 linear (<= 6e-2); an
   fp8 model's CUDA-graph replay == eager; the random Qwen2.5-0.5B-shape checkpoint's prompt logits with fp8
   against bf16 (relative error and top-1 agreement; bf16 against float32 printed beside them).
8. Sampling (tests/gpu/sampling_checks.py): the one-pass Gumbel-max sampling kernel on Qwen2.5's vocabulary: greedy
   rows == torch.argmax (ties to the first index), random rows' draws follow softmax(logits / T), and its time
   per call against the Sampler's torch path (256 rows).
9. Decode stack (tests/gpu/decode_stack_checks.py): the batch-1 decode stack's GEMVs and fused rotary + KV store +
   decode kernel in bf16 on Qwen2.5 shapes against the layer-by-layer kernels; one-sequence greedy decoding with
   the stack (graphs on) == transformers in float32.
`--only speculation|fp8|sampling|decode_stack` runs that group alone, `--skip ...` all but it. Prints a table; exits
non-zero if any check fails.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from novainfer import LLM, SamplingParams  # noqa: E402
from novainfer.attention import torch_backend  # noqa: E402
from novainfer.kernels.kv_store import store_kv  # noqa: E402
from novainfer.kernels.paged_attention import decode_attention, prefill_attention  # noqa: E402
from tests.tiny_models import hf_greedy_with, make_tiny_model  # noqa: E402
from tests.gpu.checks import check, paged_case, rows  # noqa: E402
from tests.gpu.family_checks import families_vs_hf, moe_kernel_checks, window_kernel_checks  # noqa: E402
from tests.gpu.fp8_checks import fp8_layer_checks, fp8_logits_check  # noqa: E402
from tests.gpu.sampling_checks import sampling_kernel_checks  # noqa: E402
from tests.gpu.decode_stack_checks import decode_stack_checks  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kernel_checks() -> None:
    dev, bs = "cuda", 16
    for heads, kv_heads, hd in [(14, 2, 64), (28, 4, 128)]:
        g = torch.Generator(device=dev).manual_seed(heads)
        ctx = [0, 15, 16, 17, 500, 3000]
        for q_lens in ([1] * len(ctx), [300, 1, 64, 17, 1000, 5]):
            q, kc, vc, bt, meta = paged_case(dev, g, ctx, q_lens, bs, heads, kv_heads, hd, torch.bfloat16)
            ref = torch_backend.paged_attention(q.float(), kc.float(), vc.float(), meta, hd**-0.5)
            if max(q_lens) == 1:
                for splits in (1, 8):
                    out = decode_attention(q, kc, vc, bt, meta.seq_lens, hd**-0.5, num_splits=splits)
                    e = rel(out, ref)
                    check(f"decode kernel h={heads}/{kv_heads} d={hd} splits={splits}", f"rel err {e:.2e}", e <= 1e-2)
            else:
                out = prefill_attention(q, kc, vc, bt, meta.query_start_loc, meta.seq_lens, max(q_lens), hd**-0.5)
                e = rel(out, ref)
                check(f"prefill kernel h={heads}/{kv_heads} d={hd} cached prefix", f"rel err {e:.2e}", e <= 1e-2)
        # KV store
        key = torch.randn(64, kv_heads, hd, device=dev, dtype=torch.bfloat16)
        slots = torch.randperm(kc.shape[0] * bs, device=dev)[:64]
        slots[5] = -1
        a, b = kc.clone(), vc.clone()
        torch_backend.store_kv(key[slots >= 0], key[slots >= 0], a, b, slots[slots >= 0])
        store_kv(key, key, kc, vc, slots)
        same = torch.equal(a, kc) and torch.equal(b, vc)
        check(f"kv store kv_heads={kv_heads} d={hd}", "bitwise vs index_copy", same)


def fused_op_checks() -> None:
    from types import SimpleNamespace

    from novainfer.kernels import fused_ops
    from novainfer.layers.layernorm import RMSNorm
    from novainfer.layers.rotary import RotaryEmbedding

    dev, dt = "cuda", torch.bfloat16
    for hidden, heads, kvh, hd in [(896, 14, 2, 64), (3584, 28, 4, 128)]:
        x, r = torch.randn(300, hidden, device=dev, dtype=dt), torch.randn(300, hidden, device=dev, dtype=dt)
        norm = RMSNorm(hidden).to(dev, dt)
        norm.weight.data.uniform_(0.5, 1.5)
        ref, ref_r = _torch_norm(norm, x, r)
        out, out_r = fused_ops.rms_norm(x, norm.weight, norm.eps, r)
        e = rel(out, ref)
        check(
            f"fused add+rmsnorm hidden={hidden}",
            f"rel err {e:.2e}, residual equal {torch.equal(out_r, ref_r)}",
            e <= 1e-2 and torch.equal(out_r, ref_r),
        )
        rope = RotaryEmbedding(hd, 4096, SimpleNamespace(rope_theta=1e6)).to(dev)
        qkv = torch.randn(300, (heads + 2 * kvh) * hd, device=dev, dtype=dt)
        q, k = qkv[:, : heads * hd].view(300, heads, hd), qkv[:, heads * hd : (heads + kvh) * hd].view(300, kvh, hd)
        pos = torch.randint(0, 4096, (300,), device=dev)
        cos, sin = rope.cos_cache[pos].to(dt).unsqueeze(1), rope.sin_cache[pos].to(dt).unsqueeze(1)
        fq, fk = fused_ops.rotary_embedding(pos, q, k, rope.cos_cache, rope.sin_cache)
        e = max(rel(fq, RotaryEmbedding._rotate(q, cos, sin)), rel(fk, RotaryEmbedding._rotate(k, cos, sin)))
        check(f"fused rotary heads={heads}/{kvh} d={hd}", f"rel err {e:.2e}", e <= 1e-2)
        gu = torch.randn(300, 2 * 4864, device=dev, dtype=dt)
        e = rel(fused_ops.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :4864]) * gu[:, 4864:])
        check("fused silu-and-mul", f"rel err {e:.2e}", e <= 1e-2)


def _torch_norm(norm, x, r):
    """The torch RMSNorm path (the layer itself takes the Triton path for CUDA tensors)."""
    s = x + r
    return norm._norm(s), s


def engine_vs_hf(tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = ["Hello, my name is", "The capital of France is", "def add(a, b):"]
    for arch in ("qwen2", "llama", "qwen3"):
        path = make_tiny_model(os.path.join(tmp, arch), arch, seed=7)
        llm = LLM(path, dtype="float32", gpu_memory_utilization=0.3)
        tok = llm.get_tokenizer()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        ok = all(o.outputs[0].token_ids == hf_greedy_with(hf, tok.encode(p), 32) for p, o in zip(prompts, outs))
        graphs = llm.llm_engine.executor.workers[0].model_runner.graphs is not None
        check(f"engine greedy == HF, {arch}, fp32, GPU", f"32 tokens x {len(prompts)} prompts, graphs={graphs}", ok)
        del llm, hf
        gc.collect()
        torch.cuda.empty_cache()


def graph_vs_eager(tmp: str, quantization: str | None = None) -> None:
    path = make_tiny_model(os.path.join(tmp, "qwen2_graph"), "qwen2", seed=9, layers=4)
    # 32 sequences of different lengths: a captured batch size, so eager and replay run the same GEMM shapes
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    results = {}
    quantized = True
    for eager in (True, False):
        llm = LLM(
            path,
            dtype="bfloat16",
            enforce_eager=eager,
            gpu_memory_utilization=0.3,
            max_num_seqs=64,
            quantization=quantization,
        )
        runner = llm.llm_engine.executor.workers[0].model_runner
        quantized &= quantization is None or any(p.dtype == torch.float8_e4m3fn for p in runner.model.parameters())
        quantized &= eager or runner.graphs is not None
        results[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(results[True], results[False]))
    check(
        "CUDA-graph replay == eager" + (f", quantization={quantization}" if quantization else ""),
        f"{same}/{len(prompts)} sequences identical (bf16, 48 tokens)",
        same == len(prompts) and quantized,
    )


def fp8_group(tmp: str) -> None:
    """quantization="fp8": the layer on 7B shapes, graphs with fp8 layers, 0.5B logits vs bf16."""
    from benchmarks.checkpoints import resolve_model

    fp8_layer_checks()
    graph_vs_eager(tmp, quantization="fp8")
    fp8_logits_check(resolve_model("random:qwen2.5-0.5b"), "random Qwen2.5-0.5B shape")
    gc.collect()
    torch.cuda.empty_cache()


def overlap_vs_sync(tmp: str) -> None:
    """The overlapped loop (async scheduling: step N+1 launched before N is read back, its input tokens fed
    on the device) returns the tokens of the synchronous loop, with graphs, chunked prefill and stop limits."""
    path = make_tiny_model(os.path.join(tmp, "qwen2_overlap"), "qwen2", seed=11, layers=4)
    prompts = [{"prompt_token_ids": list(range(3 + i, 33 + i + 7 * (i % 6)))} for i in range(48)]  # ids < 400
    params = [SamplingParams(temperature=0, max_tokens=8 + (i % 5) * 11, ignore_eos=True) for i in range(48)]
    params[7] = SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)
    params[9] = SamplingParams(temperature=0.8, seed=5, max_tokens=40, repetition_penalty=1.2, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = LLM(
            path,
            dtype="bfloat16",
            async_scheduling=overlap,
            gpu_memory_utilization=0.3,
            max_num_seqs=64,
            max_num_batched_tokens=512,
        )
        before = llm.llm_engine.num_generated_tokens
        results[overlap] = (
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
            llm.llm_engine.num_generated_tokens - before,
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(results[False][0], results[True][0]))
    counts = results[False][1] == results[True][1] == sum(p.max_tokens for p in params)
    check(
        "overlapped loop == synchronous loop",
        f"{same}/{len(prompts)} sequences identical (bf16, graphs), tokens counted {results[True][1]}",
        same == len(prompts) and counts,
    )


def speculation_checks(tmp: str) -> None:
    """Greedy identity with speculation on the GPU, and verify-step CUDA graphs against eager verify steps."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(os.path.join(tmp, "qwen2_spec"), "qwen2", seed=13, layers=4)
    loop = [100, 200, 300, 350] * 6
    prompts = [{"prompt_token_ids": loop[i % 4 :] + list(range(5 + i, 12 + i))} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    want = [hf_greedy_with(hf, p["prompt_token_ids"], 40) for p in prompts]
    del hf
    specs = {
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
        "draft_model k=3 (draft = target)": {"method": "draft_model", "model": path, "num_speculative_tokens": 3},
    }
    for name, spec in specs.items():
        for dtype, eager in (("float32", False), ("bfloat16", True), ("bfloat16", False)):
            llm = LLM(
                path, dtype=dtype, enforce_eager=eager, num_gpu_blocks=2048, max_num_seqs=16, speculative_config=spec
            )
            runner = llm.llm_engine.executor.workers[0].model_runner
            replays = [0]
            if runner.verify_graphs is not None:
                replay = runner.verify_graphs.replay
                runner.verify_graphs.replay = lambda n, _r=replay: (replays.__setitem__(0, replays[0] + 1), _r(n))[1]
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            m = llm.get_metrics()
            detail = (
                f"{dtype}, graphs={not eager}: acceptance {m.get('spec_acceptance_rate', 0):.2f}, "
                f"mean accepted length {m.get('spec_mean_accepted_length', 0):.2f}, verify replays {replays[0]}"
            )
            if dtype == "float32":
                same = sum(a == b for a, b in zip(got, want))
                check(
                    f"speculation {name} == HF greedy",
                    f"{same}/{len(prompts)}; {detail}",
                    same == len(prompts) and m.get("spec_num_accepted_tokens", 0) > 0 and replays[0] > 0,
                )
            elif eager:
                eager_tokens = got
            else:
                same = sum(a == b for a, b in zip(got, eager_tokens))
                check(
                    f"speculation {name}: verify graphs == eager",
                    f"{same}/{len(prompts)}; {detail}",
                    same == len(prompts) and replays[0] > 0,
                )
            del llm, runner
            gc.collect()
            torch.cuda.empty_cache()


def main() -> None:
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    groups = {
        "speculation": speculation_checks,
        "fp8": fp8_group,  # the groups --only / --skip may name
        "sampling": lambda tmp: sampling_kernel_checks(),
        "decode_stack": decode_stack_checks,
    }
    flag, name = (sys.argv[1:] + [None, None])[:2]
    if len(sys.argv) not in (1, 3) or (flag is not None and (flag not in ("--only", "--skip") or name not in groups)):
        sys.exit(f"usage: gpu_check.py [--only|--skip {'|'.join(groups)}]")
    if flag == "--only":  # one group (a re-run after a fix)
        with tempfile.TemporaryDirectory() as tmp:
            groups[name](tmp)
        return report(t0)
    kernel_checks()
    fused_op_checks()
    moe_kernel_checks()
    window_kernel_checks()
    with tempfile.TemporaryDirectory() as tmp:
        engine_vs_hf(tmp)
        families_vs_hf(tmp)
        graph_vs_eager(tmp)
        overlap_vs_sync(tmp)
        for group, run in groups.items():
            if name != group:  # --skip GROUP: it ran apart (gpu_round's fp8 part runs it first)
                run(tmp)
    report(t0)


def report(t0: float) -> None:
    print("\n| check | detail | result |\n|---|---|---|")
    for name, detail, ok in rows:
        print(f"| {name} | {detail} | {'pass' if ok else 'FAIL'} |")
    print(f"{sum(ok for *_, ok in rows)}/{len(rows)} passed in {time.time() - t0:.0f} s")
    sys.exit(0 if all(ok for *_, ok in rows) else 1)


if __name__ == "__main__":
    main()

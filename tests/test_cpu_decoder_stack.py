"""The C decoder stack of a CPU decode step (worker/cpu_decode_stack.py, kernels/cpu/decoder_stack.py) against the
layer-by-layer path it replaces: the same hidden states to the bit on tiny random GGUF models (llama with every
repacked format, qwen2 with q/k/v biases) for one sequence, a batch of ragged contexts and a verify step's per-token
rows, and close to the dequantized float32 model; the steps and models it leaves to the layers; ngram speculation's
and the default model's greedy tokens unchanged with it on or off."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from novainfer.attention import cpu_backend
from novainfer.attention.metadata import AttentionMetadata, attention_metadata, get_attention_metadata
from novainfer.kernels.cpu import library
from novainfer.spec_decode.verify_inputs import per_token_metadata
from novainfer.worker.cpu_decode_stack import CPUDecodeStack
from novainfer.worker.decode_strategy import select_decode_strategy
from novainfer.worker.kv_cache import allocate_kv_cache
from tests.test_quantized_cpu import random_blocks
from tests.tiny_models import make_tokenizer

pytestmark = pytest.mark.skipif(not library.available(), reason="needs AVX2+FMA and a C compiler")
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, BS = 256, 512, 4, 2, 3, 4
# per layer: GGUF type of each weight (q4 and int8 layouts; groups of 32 and 16; with and without zeros)
LAYER_TYPES = [
    {
        "attn_q": T.Q4_1,
        "attn_k": T.Q4_1,
        "attn_v": T.Q4_1,
        "attn_output": T.Q8_0,
        "ffn_gate": T.Q4_K,
        "ffn_up": T.Q4_K,
        "ffn_down": T.Q6_K,
    },
    {
        "attn_q": T.Q4_0,
        "attn_k": T.Q6_K,
        "attn_v": T.Q8_0,
        "attn_output": T.Q5_K,
        "ffn_gate": T.Q4_0,
        "ffn_up": T.Q4_1,
        "ffn_down": T.Q8_0,
    },
    {
        "attn_q": T.Q8_0,
        "attn_k": T.Q8_0,
        "attn_v": T.Q8_0,
        "attn_output": T.Q4_K,
        "ffn_gate": T.Q6_K,
        "ffn_up": T.Q6_K,
        "ffn_down": T.Q4_1,
    },
]


def write_gguf(path, arch: str, vocab: int, seed: int = 0) -> str:
    """A random GQA model of LAYERS layers in the given GGUF architecture (qwen2 gets q/k/v biases)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    head_dim = HIDDEN // HEADS
    w.add_tensor(
        "token_embd.weight", quantize(rng.standard_normal((vocab, HIDDEN)).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0
    )
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }
    for i, types in enumerate(LAYER_TYPES[:LAYERS]):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for name, (n, k) in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", random_blocks(types[name], n, k, rng), raw_dtype=types[name])
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.5 * rng.standard_normal(shapes[name][0])).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(400).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    return write_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf", request.param, vocab)


def load(path: str, quantized: bool = True, num_blocks: int = 40):
    """The model as the engine builds it (quantized CPU path, bf16 paged cache), or the dequantized float32
    model over a float32 cache."""
    from novainfer.layers.attention import Attention
    from novainfer.layers.quantization.gguf_cpu import GGUFCPUConfig
    from novainfer.loader.model_loader import load_hf_config, load_model

    cpu = torch.device("cpu")
    model = load_model(
        path, load_hf_config(path), torch.float32, cpu, quant_config=GGUFCPUConfig() if quantized else None
    )
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    model.kv = allocate_kv_cache(
        layers, num_blocks, BS, torch.bfloat16 if quantized else torch.float32, cpu, cpu_backend
    )
    model.stack = select_decode_strategy(model, cpu_backend)  # as the runner picks it, with the KV cache
    return model


def step_meta(tables: list[list[int]], starts: list[int], counts: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Sequence i adds counts[i] tokens after starts[i] cached ones, in the blocks tables[i]."""
    qsl = np.concatenate([[0], np.cumsum(counts)]).tolist()
    lens = [s + c for s, c in zip(starts, counts)]
    pos = torch.tensor([p for s, c in zip(starts, counts) for p in range(s, s + c)])
    rows = np.repeat(np.arange(len(counts)), counts)
    assert all(s + c <= BS * len(t) for s, c, t in zip(starts, counts, tables))  # no write past a table
    bt = torch.tensor([t + [0] * (8 - len(t)) for t in tables], dtype=torch.int32)
    slots = bt[rows, pos // BS].long() * BS + pos % BS
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=slots,
        block_tables=bt,
        max_query_len=max(counts),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    ), pos


def forward(model, ids, pos, meta, stack: bool) -> torch.Tensor:
    """The model's hidden states with the C stack on or off; the stack must take the step when on."""
    with torch.inference_mode(), attention_metadata(meta):
        out = model.stack.forward(torch.tensor(ids), pos) if stack else model(torch.tensor(ids), pos)
    assert out is not None  # on: the stack took the step
    return out


TABLES = [[7, 2, 9, 13], [0, 5, 1, 11, 3], [4], [6, 8, 10, 12]]  # shuffled blocks
PROMPT_LENS = [9, 17, 1, 12]


def prefill(model, vocab: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPT_LENS)
    meta, pos = step_meta(TABLES, [0] * n, PROMPT_LENS)
    with torch.inference_mode(), attention_metadata(meta):
        model(torch.randint(vocab, (sum(PROMPT_LENS),), generator=g), pos)


def same_with_stack_on_and_off(model, ids, meta, pos) -> torch.Tensor:
    """Runs the step both ways over the same cache contents; both must write the same K/V and give the same
    hidden states, to the bit."""
    before = model.kv.clone()
    on = forward(model, ids, pos, meta, stack=True)
    kv_on = model.kv.clone()
    model.kv.copy_(before)
    off = forward(model, ids, pos, meta, stack=False)
    assert torch.equal(model.kv, kv_on)
    assert torch.equal(on, off)
    return on


def test_decode_steps_equal_the_layer_path_to_the_bit(tiny_gguf):
    model = load(tiny_gguf)
    vocab = model.config.vocab_size
    prefill(model, vocab)
    starts = list(PROMPT_LENS)
    for step in range(3):  # ragged contexts, crossing block boundaries; then one sequence alone
        rows = [0, 1, 2, 3] if step < 2 else [1]
        meta, pos = step_meta([TABLES[i] for i in rows], [starts[i] for i in rows], [1] * len(rows))
        ids = [(17 * step + 5 * i) % vocab for i in rows]
        same_with_stack_on_and_off(model, ids, meta, pos)
        forward(model, ids, pos, meta, stack=True)  # keep the cache of the step, as the engine does
        for i in rows:
            starts[i] += 1
    # and close to the dequantized float32 model (float32 cache): what differs is rounding (bf16 K/V, int16 x)
    dense = load(tiny_gguf, quantized=False)
    prefill(dense, vocab)
    meta, pos = step_meta(TABLES, PROMPT_LENS, [1] * 4)
    ids = [3, 1, 4, 1]
    got = model.compute_logits(forward(model, ids, pos, meta, stack=True))
    with torch.inference_mode(), attention_metadata(meta):
        want = dense.compute_logits(dense(torch.tensor(ids), pos))
    assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_verify_steps_per_token_rows_equal_the_layer_path(tiny_gguf):
    model = load(tiny_gguf)
    prefill(model, model.config.vocab_size)
    meta, pos = step_meta(TABLES[:3], PROMPT_LENS[:3], [4, 3, 1])  # last token + 3, 2, 0 guesses
    meta.per_token = per_token_metadata(meta.query_start_loc_cpu, pos, meta.slot_mapping, meta.block_tables)
    same_with_stack_on_and_off(model, [5, 6, 7, 8, 9, 10, 11, 12], meta, pos)


def test_steps_and_models_it_does_not_take_run_the_layers(tiny_gguf):
    from novainfer.layers.activation import GeluAndMul

    model = load(tiny_gguf, num_blocks=80)
    stack = model.stack
    ids = torch.tensor([3, 1])
    meta, pos = step_meta(TABLES[:1], [0], [2])  # a prefill
    with attention_metadata(meta):
        assert stack.forward(ids, pos) is None
    many = [[i] for i in range(64)]
    meta, pos = step_meta(many, [1] * 64, [1] * 64)
    with attention_metadata(meta):  # any number of decode rows
        assert stack.forward(torch.arange(64), pos) is not None
    meta, _ = step_meta(TABLES[:1], [3], [1])  # a position past the rotary table: the layers' own error
    with attention_metadata(meta), pytest.raises(ValueError, match="outside the rotary table"):
        stack.forward(ids[:1], torch.tensor([300]))
    other = load(tiny_gguf)
    other.model.layers[1].mlp.act_fn = GeluAndMul()  # a piece the C stack lacks: the whole model keeps the layers
    assert select_decode_strategy(other, cpu_backend) is None


def test_a_new_kv_cache_is_rebound_the_old_one_freed_a_float32_one_left_to_the_layers(tiny_gguf):
    import gc
    import weakref
    from novainfer.layers.attention import Attention

    model = load(tiny_gguf)
    vocab = model.config.vocab_size
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    meta, pos = step_meta(TABLES, PROMPT_LENS, [1] * 4)
    for _ in range(2):  # the second time over a cache the runner bound anew
        prefill(model, vocab)
        same_with_stack_on_and_off(model, [1, 2, 3, 4], meta, pos)
        old = weakref.ref(model.kv)
        model.kv = allocate_kv_cache(layers, 40, BS, torch.bfloat16, torch.device("cpu"), cpu_backend)
        gc.collect()
        assert old() is None  # the stack's descriptors do not keep a released cache alive
    allocate_kv_cache(layers, 8, BS, torch.float32, torch.device("cpu"), cpu_backend)
    meta, pos = step_meta(TABLES[:1], [0], [1])
    with attention_metadata(meta):
        assert model.stack.forward(torch.tensor([1]), pos) is None


BAD_INDICES = [  # (what to break in a 4-sequence decode step over 40 blocks of 4, the error it must name)
    (lambda m: m.slot_mapping.__setitem__(1, 40 * BS), r"KV slot 160 \(token 1\) is outside the cache of 160 slots"),
    (
        lambda m: m.block_tables.__setitem__((2, 0), -1),
        r"block id -1 \(sequence 2, block table entry 0\) is outside the cache of 40 blocks",
    ),
    (
        lambda m: m.block_tables.__setitem__((3, 2), 40),
        r"block id 40 \(sequence 3, block table entry 2\) is outside the cache of 40 blocks",
    ),
    (
        lambda m: m.seq_lens.__setitem__(0, 8 * BS + 1),
        r"sequence 0's length 33 is outside \[1, 32\] \(its block table holds 8 blocks of 4 tokens\)",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD_INDICES)))
def test_a_bad_kv_index_raises_before_the_stack_writes_any_layer(tiny_gguf, i):
    """A slot past the cache, a negative block id, one past the cache, a length past the table: ValueError
    naming it, every layer's cache as it was; the layer-by-layer path refuses the step with the same message."""
    break_it, message = BAD_INDICES[i]
    model = load(tiny_gguf)
    prefill(model, model.config.vocab_size)
    meta, pos = step_meta(TABLES, PROMPT_LENS, [1] * 4)
    break_it(meta)
    before = model.kv.clone()
    with pytest.raises(ValueError, match=message):
        forward(model, [1, 2, 3, 4], pos, meta, stack=True)
    assert torch.equal(model.kv, before)
    with pytest.raises(ValueError, match=message):
        forward(model, [1, 2, 3, 4], pos, meta, stack=False)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [40, 41, 42]]


def test_ngram_speculation_greedy_tokens_equal_with_the_stack_on_or_off(tiny_gguf, tokenizer_dir):
    from novainfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = {}
    for spec in (None, NGRAM):
        for stack in (True, False):
            llm = LLM(tiny_gguf, tokenizer=tokenizer_dir, block_size=BS, max_model_len=128, speculative_config=spec)
            runner = llm.llm_engine.executor.workers[0].model_runner
            assert runner.decode_strategy is not None
            taken = []
            if not stack:
                runner.decode_strategy = None  # layer by layer
            else:  # count the steps the C stack computed, by kind
                real = runner.decode_strategy.forward

                def spy(*args):
                    out, meta = real(*args), get_attention_metadata()
                    kind = (
                        "verify" if meta.per_token is not None else "decode" if meta.max_query_len == 1 else "prefill"
                    )
                    taken.append((kind, out is not None))
                    return out

                runner.decode_strategy.forward = spy
            out[spec is not None, stack] = [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            ]
            if stack:  # every decode and verify step went through the stack, no prefill did
                assert all(ran == (kind != "prefill") for kind, ran in taken)
                assert {kind for kind, _ in taken} == {"prefill", "decode", "verify"} if spec else {"prefill", "decode"}
            llm.llm_engine.shutdown()
    assert out[True, True] == out[True, False] == out[False, True] == out[False, False]


def test_default_model_greedy_text_equal_with_the_stack_on_or_off():
    from novainfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "List three colours:", "def add(a, b):"]
    llm = LLM(max_model_len=256, block_size=16, enable_prefix_caching=False)
    runner = llm.llm_engine.executor.workers[0].model_runner
    stack = runner.decode_strategy
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert stack.kernel is not None  # it took the steps (the tiny models' test counts them)
    runner.decode_strategy = None  # the same engine, layer by layer
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.llm_engine.shutdown()
    assert on == off


def test_default_model_computes_in_float32_on_a_bf16_cpu(monkeypatch):
    """Where the CPU multiplies bfloat16 natively a dense model defaults to it, but GGUF weights kept quantized
    take float32 activations (the C kernels' input): bfloat16 would convert around every GEMM and leave the C
    stack out (measured on an AVX512-BF16 Xeon: 33 tok/s against 166)."""
    from novainfer import LLM, SamplingParams
    from novainfer import platform
    from novainfer.platform import default_cpu_dtype

    flags = platform.cpu_flags() | {"avx512_bf16", "amx_bf16"}
    monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
    assert default_cpu_dtype() == torch.bfloat16  # a dense model on this CPU
    llm = LLM(max_model_len=128, block_size=16, enable_prefix_caching=False)
    runner = llm.llm_engine.executor.workers[0].model_runner
    assert runner.dtype == torch.float32 and runner.kv_dtype == torch.bfloat16
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert isinstance(runner.decode_strategy, CPUDecodeStack)
    llm.llm_engine.shutdown()

"""gpt-oss GGUF files made by llama.cpp's own converter from tiny random checkpoints (MXFP4 and float experts) read back
(loader/gguf_gpt_oss.py): the config's fields, and every tensor in transformers' layout equal to the checkpoint's,
the MXFP4 experts byte for byte (gate/up interleaved again), so the experts stay in four bits; the MXFP4 file runs
in NovaInfer as its HF checkpoint does, and llama.cpp (where llama-cpp-python is installed) agrees with it on it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.gguf_checkpoint import convert_side_by_side, llama_cpp_converter
from tests.test_mxfp4 import GPT_OSS_QUANT, random_mxfp4

E, H, INTER, LAYERS, HEADS, KV, HEAD_DIM, VOCAB = 4, 64, 64, 2, 4, 2, 16, 512


def write_gpt_oss(path: str, mxfp4: bool) -> dict[str, torch.Tensor]:
    """A random gpt-oss checkpoint as the released ones store it (MXFP4 experts), or with float experts in
    transformers' layout, with the tests' tokenizer."""
    from tests.tiny_models import make_tokenizer

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(400)
    tokenizer.save_pretrained(path)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "num_local_experts": E,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
        **({"quantization_config": GPT_OSS_QUANT} if mxfp4 else {}),
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    t = {"model.embed_tokens.weight": rnd(VOCAB, H), "model.norm.weight": 1 + rnd(H), "lm_head.weight": rnd(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rnd(H)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(H)
        for name, out, inp in (("q", HEADS * HEAD_DIM, H), ("k", KV * HEAD_DIM, H), ("v", KV * HEAD_DIM, H)):
            t[p + f"self_attn.{name}_proj.weight"], t[p + f"self_attn.{name}_proj.bias"] = rnd(out, inp), rnd(out)
        t[p + "self_attn.o_proj.weight"], t[p + "self_attn.o_proj.bias"] = rnd(H, HEADS * HEAD_DIM), rnd(H)
        t[p + "self_attn.sinks"] = rnd(HEADS)
        t[p + "mlp.router.weight"], t[p + "mlp.router.bias"] = rnd(E, H), rnd(E)
        e = p + "mlp.experts."
        if mxfp4:
            t[e + "gate_up_proj_blocks"], t[e + "gate_up_proj_scales"] = random_mxfp4(E, 2 * INTER, H, seed=i)
            t[e + "down_proj_blocks"], t[e + "down_proj_scales"] = random_mxfp4(E, H, INTER, seed=10 + i)
        else:  # transformers' float layout: [E, in, out], gate/up interleaved on the last axis
            t[e + "gate_up_proj"], t[e + "down_proj"] = rnd(E, H, 2 * INTER), rnd(E, INTER, H)
        t[e + "gate_up_proj_bias"], t[e + "down_proj_bias"] = rnd(E, 2 * INTER), rnd(E, H)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    return t


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if llama_cpp_converter() is None:
        pytest.skip("llama.cpp's converter (llama-cpp-python sdist) could not be fetched")
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    tensors = {kind: write_gpt_oss(str(root / kind), kind == "mxfp4") for kind in ("mxfp4", "float")}
    outs = convert_side_by_side(
        [(str(root / kind), {"f32": str(root / f"{kind}.gguf")}) for kind in tensors], no_mtp=False
    )
    return {kind: (tensors[kind], out["f32"]) for kind, out in zip(tensors, outs)}


def test_config_from_the_gguf_metadata(files):
    from novainfer.layers.quantization.mxfp4 import Mxfp4Config
    from novainfer.layers.quantization.selector import get_quant_config
    from novainfer.loader.gguf_loader import load_gguf_config

    _, path = files["mxfp4"]
    cfg = load_gguf_config(path)
    assert type(cfg).__name__ == "GptOssConfig"
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (E, 2, INTER)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (H, HEADS, KV, HEAD_DIM)
    assert cfg.sliding_window == 8 and cfg.layer_types == ["sliding_attention", "full_attention"]
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 32.0 and rope["original_max_position_embeddings"] == 4096
    assert rope["rope_theta"] == 150000.0
    assert cfg.quantization_config["quant_method"] == "mxfp4"
    from types import SimpleNamespace

    mc = SimpleNamespace(hf_config=cfg, quantization=None, is_gguf=True)
    assert isinstance(get_quant_config(mc, torch.device("cpu")), Mxfp4Config)
    assert getattr(load_gguf_config(files["float"][1]), "quantization_config", None) is None


@pytest.mark.parametrize("kind", ["mxfp4", "float"])
def test_tensors_come_back_in_the_checkpoint_layout(files, kind):
    from novainfer.loader.gguf_loader import count_gguf_weights, iter_gguf_weights

    want, path = files[kind]
    got = dict(iter_gguf_weights(path, keep_quantized=True))
    assert count_gguf_weights(path) == len(got)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g, t), name  # f32 weights as written, the MXFP4 experts byte for byte


PROMPTS = [[5, 9, 300, 7, 150, 12, 44, 80, 31, 200, 17], [100, 3, 250, 61], [42] * 3 + list(range(60, 75))]
N = 12


def greedy(path: str, **kw) -> list:
    """NovaInfer's greedy completions (token ids, logprobs) of PROMPTS from a checkpoint directory or GGUF file."""
    from novainfer import LLM, SamplingParams

    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=8, **kw)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        model = llm.llm_engine.executor.workers[0].model_runner.model
        assert not hasattr(model.model.layers[0].mlp.experts, "w13_weight")  # the experts stayed MXFP4
        return [
            (o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs
        ]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def mxfp4_dir(files, tmp_path_factory):
    """The HF MXFP4 checkpoint the GGUF file was converted from (write_gpt_oss is deterministic)."""
    path = str(tmp_path_factory.mktemp("gpt-oss-hf") / "mxfp4")
    write_gpt_oss(path, True)
    return path


def test_tokenizer_from_the_gguf(files, mxfp4_dir):
    """The file's tokenizer (converted by transformers as PreTrainedTokenizerFast: AutoTokenizer would read the
    file's config first, and transformers' reader fails on gpt-oss's rope.scaling keys) encodes as the HF one."""
    from transformers import AutoTokenizer

    from novainfer.loader.gguf_loader import load_gguf_tokenizer

    text = "Hello, my name is Bob and the capital of France is"
    assert load_gguf_tokenizer(files["mxfp4"][1]).encode(text) == AutoTokenizer.from_pretrained(mxfp4_dir).encode(text)


def test_mxfp4_gguf_runs_as_its_hf_checkpoint(files, mxfp4_dir):
    """NovaInfer on the GGUF file (MXFP4 experts kept in four bits; its own tokenizer) gives the HF MXFP4
    checkpoint's greedy tokens, with the same logprobs: the file holds the same bytes."""
    from_gguf, from_hf = greedy(files["mxfp4"][1]), greedy(mxfp4_dir)
    for (g_tokens, g_lps), (h_tokens, h_lps) in zip(from_gguf, from_hf):
        assert g_tokens == h_tokens
        assert max(abs(a - b) for a, b in zip(g_lps, h_lps)) < 1e-5


def test_llama_cpp_runs_the_same_file(files):
    """llama.cpp (llama-cpp-python) on the same MXFP4 GGUF, teacher-forced on NovaInfer's greedy continuations:
    its top-1 token agrees with ours at >= 90% of the generated positions (its MXFP4 GEMMs take activations in
    Q8_0, ours in int16 per 32, so near-ties may flip)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = files["mxfp4"][1]
    ours = greedy(path)
    llm = llama_cpp.Llama(path, n_ctx=64, n_batch=64, n_threads=1, logits_all=True, verbose=False)
    agree = total = 0
    for prompt, (tokens, _) in zip(PROMPTS, ours):
        llm.reset()
        llm.eval(prompt + tokens[:-1])
        theirs = llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(theirs, tokens))
        total += len(tokens)
    print(f"llama.cpp {llama_cpp.__version__} top-1 agreement with NovaInfer: {agree}/{total}")
    assert agree >= 0.9 * total

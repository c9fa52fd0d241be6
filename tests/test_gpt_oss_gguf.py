"""gpt-oss GGUF files made by llama.cpp's own converter from tiny random checkpoints (MXFP4 and float experts) read back
(loader/gguf_gpt_oss.py): the config's fields, and every tensor in transformers' layout equal to the checkpoint's,
the MXFP4 experts byte for byte (gate/up interleaved again), so the experts stay in four bits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.gguf_checkpoint import convert_hf_to_gguf, llama_cpp_converter
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
    out = {}
    for kind in ("mxfp4", "float"):
        tensors = write_gpt_oss(str(root / kind), kind == "mxfp4")
        out[kind] = tensors, convert_hf_to_gguf(str(root / kind), str(root / f"{kind}.gguf"), "f32", no_mtp=False)
    return out


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

"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1): our GGUF reader and the engine agree with
transformers' own GGUF loading, weight for weight and token for token."""

import os
import subprocess
import sys

import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.loader.default_model import DEFAULT_MODEL_FILE, default_model_path
from novainfer.loader.gguf_loader import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer
from tests.hf_gguf import hf_model_from_gguf
from tests.tiny_models import hf_greedy_with


@pytest.fixture(scope="module")
def gguf_path():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith(DEFAULT_MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return hf_model_from_gguf(gguf_path)


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_model_len=512, block_size=16, dtype="float32")


def test_config_matches_transformers(gguf_path, hf_model):
    ours, ref = load_gguf_config(gguf_path), hf_model.config
    for key in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
    ]:
        assert getattr(ours, key) == pytest.approx(getattr(ref, key)), key
    assert ours.architectures == ["LlamaForCausalLM"]
    from novainfer.layers.rotary import rope_parameters

    assert rope_parameters(ours)["rope_theta"] == rope_parameters(ref)["rope_theta"] == 100000.0


def test_weights_match_transformers(gguf_path, hf_model):
    ref = hf_model.state_dict()
    ours = dict(iter_gguf_weights(gguf_path))
    expected = set(ref) - {"lm_head.weight"}  # tied to the embedding in this model
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name  # includes undoing llama.cpp's q/k row permutation


def test_tokenizer_and_chat_template(gguf_path, default_llm):
    tok = load_gguf_tokenizer(gguf_path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids and tok.decode(ids).rstrip().endswith("<|im_start|>assistant")
    assert default_llm.get_tokenizer().encode("Hello world") == tok.encode("Hello world")


def test_greedy_chat_matches_transformers(default_llm, hf_model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_with(hf_model, out.prompt_token_ids, 32)
    assert "Paris" in out.outputs[0].text


def test_cli_generate_uses_default_model():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "novainfer.entrypoints.cli",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_cli_chat_loop_answers_and_exits():
    proc = subprocess.run(
        [sys.executable, "-m", "novainfer.entrypoints.cli", "chat", "--max-tokens", "16", "--max-model-len", "512"],
        input="What is the capital of France?\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout

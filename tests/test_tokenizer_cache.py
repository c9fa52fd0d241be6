"""The tokenizer converted from a GGUF file is saved under CACHE_DIR after the first load (the conversion takes
~9 s for the default model on the 2-core machine) and read back from there, the same tokenizer as
transformers' own conversion; a damaged entry is converted again."""

import os

import pytest
from transformers import AutoTokenizer

from novainfer import platform
from novainfer.loader import gguf_loader
from novainfer.loader.default_model import default_model_path

TEXTS = ["Hello, world!", "  leading spaces\n\ttabs and ünïcödé ✓ 1234567", "<|im_start|>user\nhi<|im_end|>\n", ""]


def same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids, text
        ids = a(text).input_ids
        assert a.decode(ids) == b.decode(ids)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert a.apply_chat_template(chat, add_generation_prompt=True) == b.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert (a.eos_token_id, a.bos_token_id, len(a), a.all_special_tokens) == (
        b.eos_token_id,
        b.bos_token_id,
        len(b),
        b.all_special_tokens,
    )


@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """CACHE_DIR in a temporary directory; the list of GGUF conversions transformers was asked for."""
    monkeypatch.setattr(platform, "CACHE_DIR", str(tmp_path))
    calls, real = [], AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    return calls


def test_the_gguf_tokenizer_is_converted_once_then_read_from_the_cache(conversions, tmp_path):
    path = default_model_path()
    converted = gguf_loader.load_gguf_tokenizer(path)
    cached = gguf_loader.load_gguf_tokenizer(path)
    assert conversions == [os.path.basename(path)]  # the second load did not convert
    same_tokenizer(cached, converted)
    (entry,) = os.listdir(tmp_path / "tokenizers")  # one entry, no temporary directory left behind
    with open(tmp_path / "tokenizers" / entry / "tokenizer.json", "w") as f:
        f.write("{not json")
    again = gguf_loader.load_gguf_tokenizer(path)  # a damaged entry: converted again, and replaced
    assert conversions == [os.path.basename(path)] * 2
    same_tokenizer(again, converted)
    same_tokenizer(gguf_loader.load_gguf_tokenizer(path), converted)
    assert len(conversions) == 2

"""transformers' own GGUF loading, the tests' reference for our GGUF reader, without its repeated parsing."""

from __future__ import annotations

import contextlib
import functools
import os

import gguf
import torch
from transformers import AutoModelForCausalLM


@contextlib.contextmanager
def _parse_once():
    """transformers opens a GGUF twice (config, then weights) and rebuilds gguf's tensor-name map for each tensor;
    both are pure functions of their arguments, so while loading each is computed once (22 s -> 10 s for the
    default model). The values read are unchanged."""
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, gguf.GGUFReader] = {}

    def cached_reader(path, mode: str = "r") -> gguf.GGUFReader:
        key = f"{os.path.realpath(os.fspath(path))}:{mode}"
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = cached_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def hf_model_from_gguf(path: str) -> torch.nn.Module:
    """transformers' float32 model of a GGUF file, in eval mode."""
    with _parse_once():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.eval()

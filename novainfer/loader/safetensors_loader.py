"""Reads the tensors of a Hugging Face folder's *.safetensors shards, one at a time."""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def count_safetensors_weights(model_dir: str) -> int:
    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            total += len(list(f.keys()))
    return total

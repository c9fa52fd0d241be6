"""Chat messages -> prompt token ids, shared by the offline LLM.chat and the server."""

from __future__ import annotations

from typing import Any


def apply_chat_template(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
) -> list[int]:
    """The model's chat template applied to one conversation; a plain `role: content` layout if it has none."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list(tokenizer.encode(text + ("assistant:" if add_generation_prompt else "")))
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)

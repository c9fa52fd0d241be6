"""Chat templates on the server: which client `chat_template_kwargs` are accepted, and rendering off the event loop.

A client-supplied template (`chat_template_kwargs.chat_template`) is code run by the server (vLLM CVE-2025-61620:
a loop or a huge string stalls or bloats it), so it is refused unless the operator passed
--trust-request-chat-template. Keys that are apply_chat_template's own arguments (tokenize, return_tensors, ...)
would change what it returns, so they are refused too. Rendering and tokenizing run in a worker thread, so a
slow template or a large input never holds up the other requests or /health.
"""

from __future__ import annotations

import asyncio
from typing import Any

from novainfer.server.chat_utils import apply_chat_template
from novainfer.server.errors import APIError

TEMPLATE_KEY = "chat_template"
# apply_chat_template's own parameters: the server sets them, a client value would change the result's type
_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def checked_template_kwargs(kwargs: dict[str, Any] | None, trust_request_chat_template: bool) -> dict[str, Any]:
    """The client's chat_template_kwargs, or a 400 naming the first key the server does not accept."""
    kwargs = kwargs or {}
    if TEMPLATE_KEY in kwargs and not trust_request_chat_template:
        raise APIError(
            400,
            "chat_template_kwargs.chat_template: a client-supplied chat template is refused; the "
            "server's operator may allow it with --trust-request-chat-template",
            param="chat_template_kwargs.chat_template",
        )
    for key in kwargs:
        if key in _RESERVED:
            raise APIError(
                400,
                f"chat_template_kwargs.{key} is set by the server and may not be given",
                param=f"chat_template_kwargs.{key}",
            )
    return kwargs


async def render_chat(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool, **template_kwargs: Any
) -> list[int]:
    """apply_chat_template in a worker thread: the event loop keeps serving while a template renders."""
    return await asyncio.to_thread(apply_chat_template, tokenizer, messages, add_generation_prompt, **template_kwargs)


async def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode in a worker thread (a prompt may be megabytes)."""
    return list(await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens))

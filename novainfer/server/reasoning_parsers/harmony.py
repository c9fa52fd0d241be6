"""gpt-oss's reasoning: the harmony `analysis` channel is reasoning, the `final` channel the answer."""

from __future__ import annotations

from typing import Any

from novainfer.server.harmony import CHANNEL, MESSAGE, split_completion


class HarmonyReasoningParser:
    def __init__(self, prompt_tail: str = ""):
        """prompt_tail is not needed: a harmony completion always opens in its first message's header."""

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of the output so far, each None while absent."""
        split = split_completion(text, final)
        return split.reasoning, split.content

    def end_token_ids(self, tokenizer: Any) -> list[int]:
        """The ids of `<|channel|>final<|message|>`: a response format constrains the final answer."""
        return list(tokenizer.encode(CHANNEL + "final" + MESSAGE, add_special_tokens=False))

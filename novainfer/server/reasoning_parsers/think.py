"""`<think>...</think>` reasoning: the text up to the first `</think>` is reasoning, the rest is the answer.
The block opens either in the output (Qwen3 writes `<think>` first) or already in the prompt (DeepSeek-R1 and
Qwen3.5 templates end the prompt with `<think>`), in which case the output starts inside the reasoning."""

from __future__ import annotations

from novainfer.server.tool_parsers.base import partial_tail


class ThinkReasoningParser:
    start, end = "<think>", "</think>"

    def __init__(self, prompt_tail: str = ""):
        """prompt_tail: the end of the rendered prompt; it opens the reasoning when its last `<think>` is not
        closed."""
        self.starts_inside = prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of the output so far. Reasoning is None when the output has none; content is None
        while (or, final, because) the output has not left the reasoning. Unfinished, both are prefixes of what
        they will be: a tail that may begin `</think>` is held back."""
        body = text
        if not self.starts_inside:
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                body = stripped[len(self.start) :]
            elif not final and self.start.startswith(stripped):
                return None, None  # may still become `<think>`
            else:
                return None, text
        at = body.find(self.end)
        if at < 0:
            return body[: len(body) - (0 if final else partial_tail(body, self.end))].lstrip(), None
        return body[:at].lstrip(), body[at + len(self.end) :].lstrip()

    def end_token_ids(self, tokenizer) -> list[int]:
        """The token ids of `</think>`: structured outputs start after them."""
        return list(tokenizer.encode(self.end, add_special_tokens=False))

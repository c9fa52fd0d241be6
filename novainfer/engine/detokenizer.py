"""Incremental, UTF-8-safe detokenization and stop-string search.

Byte-level BPE can split one character over several tokens; decoding them one by one gives U+FFFD.
Like vLLM, we decode a short window of tokens (from prefix_offset) and only release the text past
read_offset once it no longer ends in an incomplete character.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # start the window inside the prompt, so the first output token decodes with its left context
        self.token_ids: list[int] = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.num_output_tokens = 0  # output tokens taken so far (by step() or flush())
        self._backend = fast_backend(tokenizer)
        # the decoded text of token_ids[prefix_offset:read_offset], when known without decoding it again
        self._prefix_text: str | None = None
        self._delta_is_prefix = self._backend is not None and is_byte_level(self._backend)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be '' while a character is incomplete)."""
        self.token_ids.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        return self._release(final=False)

    def flush(self, output_token_ids: list[int] = ()) -> None:
        """At the output's end: take the output's tokens that step() never saw (all of them when nobody read the
        text before the end: one decode call then) and release the text step() held back, a trailing incomplete
        character included (as U+FFFD, so the text equals tokenizer.decode of the output); idempotent.

        Streamed and deferred outputs thus end with the same text, even when the last token both completes
        one character and starts another."""
        unseen = output_token_ids[self.num_output_tokens :]
        self.token_ids.extend(unseen)
        self.num_output_tokens += len(unseen)
        self._release(final=True)

    def _release(self, final: bool) -> str:
        """Move the text decoded past read_offset into output_text, unless it ends mid-character."""
        prefix = self._prefix_text
        if prefix is None:
            prefix = self._prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_INCOMPLETE) and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        # byte-level BPE decodes a run of tokens as their concatenated bytes; when the window's bytes before and
        # after the new tokens were both valid UTF-8, the new window's text is the delta itself: one decode call
        # per token instead of two (a U+FFFD anywhere means invalid bytes whose decoding depends on context)
        valid = self._delta_is_prefix and _INCOMPLETE not in full and _INCOMPLETE not in prefix
        self._prefix_text = delta if valid else None
        self.output_text += delta
        return delta


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends in this step's new text; return it and the length to truncate to."""
    if new_char_count == 0:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(output_text) - new_char_count - len(s) + 1)
        idx = output_text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, idx + len(s) if include_stop_str_in_output else idx


def fast_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast HF tokenizer whose decode() adds nothing to it (no space clean-up):
    calling it directly skips transformers' per-call conversions, most of the cost of a one-token decode."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend if hasattr(backend, "decode") else None


def is_byte_level(backend: Any) -> bool:
    """Whether a Rust tokenizer's decoder is plain byte-level BPE (GPT-2, Llama 3, Qwen2): the text of a run of
    tokens is their bytes as UTF-8, with nothing stripped or replaced."""
    from tokenizers import decoders

    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)

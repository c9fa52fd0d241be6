"""Front-end input processing: a prompt (text, token ids or a dict of them) becomes a checked, tokenized
EngineCoreRequest. The engine core runs the same checks on what it receives (check_request)."""

from __future__ import annotations

import time
from typing import Any

from novainfer.engine.messages import EngineCoreRequest
from novainfer.sampling_params import SamplingParams
from novainfer.structured_output import StructuredOutputManager

PromptType = str | list[int] | dict


def check_request(token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError for a request the engine cannot serve, before anything is queued."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens, which leaves no room to generate within max_model_len={max_model_len}"
        )
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


class Processor:
    """Tokenizes prompts and checks them against the served model's limits."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        structured_output: StructuredOutputManager | None = None,
    ):
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        self.structured_output = structured_output  # compiles constraints here, so a bad one fails before queueing

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text if any, the request for the core); ValueError when it cannot be served."""
        text, token_ids = self._tokenize(prompt)
        check_request(token_ids, params, self.max_model_len, self.vocab_size)
        if params.structured_outputs is not None and self.structured_output is not None:
            self.structured_output.compile(params.structured_outputs)  # cached: the core finds it compiled
        now = time.monotonic() if arrival_time is None else arrival_time
        return text, EngineCoreRequest(request_id, token_ids, params, now)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

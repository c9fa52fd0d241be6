"""Pydantic schemas of the OpenAI API (field names as OpenAI's, plus vLLM's sampling extensions).

Sampling value ranges come from SamplingParams' RANGES, so /openapi.json publishes the bounds the engine
enforces; MAX_N, MAX_LOGPROBS and MAX_SEQUENCES are the server's own limits on one request's work.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from novainfer.sampling_params import RANGES

MAX_N = 128  # choices per prompt, as OpenAI's limit on n: a huge n would hold the engine for minutes
MAX_LOGPROBS = 20  # per token, as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_SEQUENCES = 1024  # prompts x n in one request: it holds one admission slot, so its work must be bounded

TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _bounded(name: str, default: Any = None, **extra: Any) -> Any:
    """A Field with SamplingParams' range for name (plus any extra bounds), so the schema documents it."""
    return Field(default, **{**RANGES[name].field_bounds(), **extra})


class OpenAIModel(BaseModel):
    # unknown OpenAI fields are accepted and ignored, as vLLM does; known ones must have their documented JSON
    # type (strict: lax mode took `"min_p": false` as 0.0 and `"n": "2"` as 2, which the schema does not allow)
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    min_p: float | None = _bounded("min_p")
    n: int = _bounded("n", 1, le=MAX_N)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = _bounded("seed")
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    min_tokens: int = _bounded("min_tokens", 0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: str | None = Field(None, description="NovaInfer extension: keep this conversation's history "
                                                     "on the server so the next turn hits the prefix cache")


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = _bounded("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = _bounded("logprobs", le=MAX_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | \
        Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    logprobs: int | None = _bounded("logprobs", le=MAX_LOGPROBS)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class _Choice(BaseModel):
    """What a chat and a text choice share."""

    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChoice(_Choice):
    message: ChatResponseMessage


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "novainfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[TokenId]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

"""Pydantic schemas of Anthropic's Messages API requests (POST /v1/messages, POST /v1/messages/count_tokens): the
fields this server serves; any other field is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from novainfer.server.protocol import NonEmptyStr, OpenAIModel, _bounded
from novainfer.server.protocol_responses import by_type, not_one_of


_KNOWN_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class CacheControl(OpenAIModel):
    """A no-op: the prefix cache keeps every prompt's blocks without being asked."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(OpenAIModel):
    """An earlier turn's thinking: the assistant message's reasoning_content (the template decides whether to show it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIModel):
    type: Literal["redacted_thinking"]
    data: str


class UnsupportedBlock(OpenAIModel):
    """image / document / search_result / server tool blocks: accepted by the schema so the 400 can name them."""

    model_config = {"extra": "allow"}
    type: str = not_one_of(_KNOWN_BLOCKS)


ContentBlock = by_type(
    {
        "text": TextBlock,
        "tool_use": ToolUseBlock,
        "tool_result": ToolResultBlock,
        "thinking": ThinkingBlock,
        "redacted_thinking": RedactedThinkingBlock,
    },
    UnsupportedBlock,
)


class AnthropicMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(OpenAIModel):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None  # forced tools (any / tool) follow input_schema; under auto, strict ones
    cache_control: CacheControl | None = None


class AnthropicToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(OpenAIModel):
    """enabled: thinking blocks carry the model's reasoning when it has any; budget_tokens is not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None
    effort: str | None = None  # a harmony model's reasoning_effort (low, medium, high); a no-op for others


class AnthropicMetadata(OpenAIModel):
    user_id: str | None = None  # a no-op


class CountTokensRequest(OpenAIModel):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = _bounded("max_tokens", ...)
    stop_sequences: list[NonEmptyStr] | None = None
    stream: bool = False
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    metadata: AnthropicMetadata | None = None
    service_tier: str | None = None  # a no-op


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error object, the error shape of the /v1/messages routes."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
    request_id: str | None = None

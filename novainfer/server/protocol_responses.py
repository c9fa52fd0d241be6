"""Pydantic schemas of OpenAI's Responses API requests (POST /v1/responses): the fields this server serves;
any other field is a 400 naming it, as on the chat routes."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from novainfer.server.protocol import OpenAIModel, _bounded

_STATUS = Literal["in_progress", "completed", "incomplete"]
# the catch-all part / item types exclude these in the published schema, so its oneOf has exactly one match
_KNOWN_PARTS = ("input_text", "output_text")
_KNOWN_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class InputText(OpenAIModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIModel):
    """An earlier assistant message's text, sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class UnsupportedPart(OpenAIModel):
    """input_image / input_file / refusal parts: accepted by the schema so the 400 can name them."""

    model_config = {"extra": "allow"}
    type: str = Field(..., json_schema_extra={"not": {"enum": list(_KNOWN_PARTS)}})


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _KNOWN_PARTS else "other"


ContentPart = Annotated[Union[Annotated[InputText, Tag("input_text")], Annotated[OutputText, Tag("output_text")],
                              Annotated[UnsupportedPart, Tag("other")]], Discriminator(_part_tag)]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: _STATUS | None = None
    phase: str | None = None


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _STATUS | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: _STATUS | None = None


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIModel):
    """An earlier turn's reasoning: accepted, and left out of the prompt (chat templates drop past thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: _STATUS | None = None


class UnsupportedItem(OpenAIModel):
    """Any other item type (item_reference, built-in tool calls): accepted by the schema so the 400 names it."""

    model_config = {"extra": "allow"}
    type: str = Field(..., json_schema_extra={"not": {"enum": list(_KNOWN_ITEMS)}})


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in _KNOWN_ITEMS else "other"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")], Annotated[UnsupportedItem, Tag("other")]],
                      Discriminator(_item_tag)]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a no-op: the model decides its length


class ReasoningConfig(OpenAIModel):
    """A no-op: reasoning items appear when the model reasons, whatever the effort asked."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(OpenAIModel):
    include_obfuscation: bool | None = None  # a no-op: events are not padded


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools; a built-in tool is a 400 naming it
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    background: bool | None = None  # only false: there is no background queue
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old items) is not done
    include: list[str] | None = None  # only empty: no extra output data is produced
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = None  # only 0: log-probabilities are not served here
    # documented no-ops: they cannot change the output
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

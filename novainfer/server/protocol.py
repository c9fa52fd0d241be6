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
# client-controlled state: each stop string is checked against every step's new text, each message rendered,
# each session id kept; unbounded, a single request could make every step or every turn slow
MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 1024  # chat messages per request
MAX_SESSION_ID_CHARS = 256
MAX_LOGPROB_ENTRIES = 1 << 20  # sequences x completion tokens x (logprobs + 1): entries in one response

TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _bounded(name: str, default: Any = None, **extra: Any) -> Any:
    """A Field with SamplingParams' range for name (plus any extra bounds), so the schema documents it."""
    return Field(default, **{**RANGES[name].field_bounds(), **extra})


class OpenAIModel(BaseModel):
    # no field is silently ignored: an unknown one is a 400 naming it (README, "Request fields"); known ones must
    # have their documented JSON type (strict: lax mode took `"min_p": false` as 0.0 and `"n": "2"` as 2)
    model_config = ConfigDict(extra="forbid", strict=True)


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` request object (its StructuredOutputsParams); exactly one field is set."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(..., max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced; strict also closes its objects to extra keys


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow the closed schema; under "auto", strict ones do too


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]]


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # a no-op: chunks are not padded


class SamplingFields(OpenAIModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    min_p: float | None = _bounded("min_p")
    n: int = _bounded("n", 1, le=MAX_N)
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = _bounded("seed")
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    min_tokens: int = _bounded("min_tokens", 0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # documented no-ops: they cannot change the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    session_id: str | None = Field(
        None,
        max_length=MAX_SESSION_ID_CHARS,
        description="NovaInfer extension: keep this conversation's history "
        "on the server so the next turn hits the prefix cache",
    )


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    reasoning_content: str | None = None  # an assistant message's reasoning (vLLM's name)
    reasoning: str | None = None  # the same, under vLLM's newer name

    def text(self) -> str:
        """The content as one string (text parts joined; none is "")."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it (tool calls with their arguments parsed, as HF templates expect)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": parse_arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # Qwen templates read reasoning_content, gpt-oss's (harmony analysis) thinking
            msg["reasoning_content"] = msg["thinking"] = reasoning
        return msg


def parse_arguments(arguments: str) -> Any:
    """Tool-call arguments as a template takes them: the parsed object, or the text when it is not JSON."""
    import json

    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = _bounded("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = _bounded("logprobs", le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None  # text is the only output this server makes
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # to the chat template; harmony models (gpt-oss) take low, medium, high


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: int | None = _bounded("logprobs", le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = _bounded("prompt_logprobs", le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(
        None, description="a thinking model's reasoning (the text of its <think> block); only for such models"
    )
    reasoning: str | None = Field(None, description="the same text under vLLM's newer name")
    tool_calls: list[ToolCall] | None = Field(None, description="the complete calls; absent when there are none")


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

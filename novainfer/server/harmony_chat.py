"""Chat completions of a harmony model (gpt-oss): what the request adds to the prompt and sampling (reasoning
effort, the end-of-completion tokens, special tokens kept for the parser), and each choice's output as OpenAI's
message: `analysis` -> reasoning_content, `final` (and preambles) -> content, `to=functions.NAME` -> tool_calls,
whole or as stream deltas."""

from __future__ import annotations

from typing import Any

from novainfer.sampling_params import SamplingParams
from novainfer.server.errors import APIError
from novainfer.server.protocol import parse_arguments
from novainfer.server.harmony import REASONING_EFFORTS, HarmonyMessage, call_name, split_completion, stop_token_ids
from novainfer.server.tool_calling import ToolCallStream, ToolPlan, call_dict, finish_reason, new_call_id
from novainfer.server.tool_parsers import ParsedCall

_TOOL_MODES = ("auto", "required", "named")
# chat_template_kwargs the gpt-oss template reads that ask for what this server does not do
_UNSERVED_KWARGS = {"builtin_tools": "built-in tools (browser, python) are not run by this server"}


def harmony_template_kwargs(reasoning_effort: str | None, client_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The template kwargs of a harmony request: the reasoning effort (low, medium, high) as the template reads it;
    a 400 naming a field harmony has no meaning for here."""
    for key, why in _UNSERVED_KWARGS.items():
        if client_kwargs.get(key):
            raise APIError(400, f"chat_template_kwargs.{key}: {why}", param=f"chat_template_kwargs.{key}")
    if reasoning_effort is None:
        return client_kwargs
    if reasoning_effort not in REASONING_EFFORTS:
        raise APIError(
            400,
            f"reasoning_effort {reasoning_effort!r}: harmony models take one of {', '.join(REASONING_EFFORTS)}",
            param="reasoning_effort",
        )
    return {**client_kwargs, "reasoning_effort": reasoning_effort}


def harmony_sampling(params: SamplingParams, tokenizer: Any) -> None:
    """Keep the format's special tokens in the text (the parser reads them) and stop at `<|return|>` and
    `<|call|>`, whatever the checkpoint's generation config lists."""
    params.skip_special_tokens = False
    params.spaces_between_special_tokens = False
    stops = list(params.stop_token_ids or [])
    params.stop_token_ids = stops + [t for t in stop_token_ids(tokenizer) if t not in stops]


def history_message(text: str) -> dict[str, Any]:
    """A finished completion as the assistant message a later turn's template renders (a session's history): the
    answer, the reasoning as `thinking`, the calls with their arguments parsed (as HF templates take them)."""
    split = split_completion(text, final=True)
    msg: dict[str, Any] = {"role": "assistant", "content": split.content or ""}
    if split.reasoning is not None:
        msg["reasoning_content"] = msg["thinking"] = split.reasoning
    if split.calls:
        msg["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": call_name(m), "arguments": parse_arguments(m.content)},
            }
            for m in split.calls
        ]
    return msg


class HarmonyChoiceOutput:
    """One chat choice's parsing state for a harmony completion (the text is re-read whole at every step)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent_reasoning = 0
        self.sent_content = 0
        self.tools = ToolCallStream(plan)

    def _calls(self, calls: list[HarmonyMessage], finished: bool, reason: str | None) -> list[HarmonyMessage]:
        """The calls to report: none without tools; once finished, not one cut by max_tokens (a stop token's text
        may be left out of the output, so an open call that stopped is whole)."""
        if self.plan.mode not in _TOOL_MODES:
            return []
        return [m for m in calls if not finished or m.end is not None or reason != "length"]

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the whole message, finish_reason) of a finished output."""
        split = split_completion(text, final=True)
        calls = self._calls(split.calls, True, reason)
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": split.content,
            "reasoning_content": split.reasoning,
            "reasoning": split.reasoning,
        }
        if calls:
            msg["tool_calls"] = [call_dict(ParsedCall(call_name(m), m.content)) for m in calls]
        return msg, finish_reason(self.plan, bool(calls), reason)

    def deltas(self, text: str, finished: bool, reason: str | None) -> list[dict]:
        """The deltas that bring the streamed message up to the output so far."""
        split = split_completion(text, final=finished)
        out: list[dict] = []
        if split.reasoning is not None and len(split.reasoning) > self.sent_reasoning:
            piece = split.reasoning[self.sent_reasoning :]
            out.append({"reasoning_content": piece, "reasoning": piece})
            self.sent_reasoning = len(split.reasoning)
        if split.content is not None and len(split.content) > self.sent_content:
            out.append({"content": split.content[self.sent_content :]})
            self.sent_content = len(split.content)
        calls = self._calls(split.calls, finished, reason)
        return out + self.tools.call_deltas([ParsedCall(call_name(m), m.content) for m in calls])

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self.plan, bool(self.tools.ids), reason)

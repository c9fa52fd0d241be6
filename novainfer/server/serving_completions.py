"""POST /v1/chat/completions and POST /v1/completions: the request to the engine, the engine's outputs
to OpenAI's response objects, whole or as SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from novainfer.outputs import CompletionOutput, RequestOutput
from novainfer.server.async_engine import EngineDeadError, RequestFailedError
from novainfer.server.chat_templates import checked_template_kwargs, encode, render_chat
from novainfer.server.errors import APIError, error_body
from novainfer.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    join_completion_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)
from novainfer.server.protocol import MAX_SEQUENCES, ChatCompletionRequest, CompletionRequest
from novainfer.server.chat_output import ChatFormat, ChoiceOutput
from novainfer.server.harmony_chat import (
    HarmonyChoiceOutput,
    harmony_sampling,
    harmony_template_kwargs,
    history_message,
)
from novainfer.server.reasoning_parsers import get_reasoning_parser
from novainfer.server.sse import EventStream
from novainfer.server.serving import Generation, OpenAIServing, ServedModel, abort_on_disconnect, held_back
from novainfer.server.sessions import continue_conversation
from novainfer.server.structured_request import structured_outputs_params
from novainfer.server.tool_calling import ToolConfig, plan_tools, template_inputs


class CompletionHandler:
    """Shared by both endpoints; chat and text differ in prompts, choice shape and logprobs shape."""

    def __init__(
        self,
        serving: OpenAIServing,
        tools: ToolConfig | None = None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
    ):
        self.serving = serving
        self.trust_request_chat_template = trust_request_chat_template  # --trust-request-chat-template
        self.tools = tools or ToolConfig()
        self.reasoning_parser = reasoning_parser  # --reasoning-parser; None: from each model's chat template
        self.formats: dict[str, ChatFormat] = {}

    # ---- building the engine requests ----------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request_id: str, raw: Request):
        model = self.serving.resolve_model(req.model)
        self.serving.check_capacity(model, request_id)
        fmt = self.chat_format(model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        plan = plan_tools(req, self.tools, fmt.tool_parser, model.tokenizer)
        constraint = structured_outputs_params(req)
        if plan.structured is not None and constraint is not None:
            what = (
                "strict tools"
                if plan.mode == "auto"
                else f"tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'named'}"
            )
            raise APIError(
                400,
                f"{what} already constrain(s) the output; drop response_format / structured_outputs",
                param="tool_choice",
            )
        params = self.serving.sampling_params(
            req,
            max_tokens,
            (req.top_logprobs or 0) if req.logprobs else None,
            structured_outputs=plan.structured or constraint,
        )
        self.serving.check_logit_bias(model, params)
        client_kwargs = self.template_kwargs(req, fmt)
        if fmt.harmony:
            harmony_sampling(params, model.tokenizer)
        messages = [m.to_template() for m in req.messages]
        sessions = self.serving.sessions
        session = sessions.find(req.session_id) if req.session_id else None  # made only once the turn succeeds
        if session is not None:
            messages = continue_conversation(session.messages, messages)
        ids = await self.render_prompt(model, messages, plan, req.add_generation_prompt, client_kwargs)
        self.serving.check_prompt(model, ids, max_tokens)
        self.serving.check_logprob_work(model, [ids], req.n, max_tokens, params.logprobs, "top_logprobs")
        reasoning = None
        if fmt.reasoning_parser and client_kwargs.get("enable_thinking", True) is not False:
            tail = model.tokenizer.decode(ids[-32:], skip_special_tokens=False)
            reasoning = get_reasoning_parser(fmt.reasoning_parser, tail)
            if params.structured_outputs is not None and params.structured_outputs.after_tokens is None:
                # the constraint holds for what follows the reasoning
                params.structured_outputs.after_tokens = reasoning.end_token_ids(model.tokenizer)
        trim: tuple[str, ...] = ()
        if plan.mode == "auto" and plan.parser.needs_special_tokens and not fmt.harmony:  # special call markers
            params.skip_special_tokens = False
            trim = tuple(t for t in model.tokenizer.all_special_tokens if t)
        gen = await self.serving.start(model, request_id, [ids], params, [None])

        def remember(outs) -> None:
            if req.session_id:
                text = outs[0].outputs[0].text
                reply = history_message(text) if fmt.harmony else {"role": "assistant", "content": text}
                sessions.get(req.session_id).messages = messages + [reply]

        make: Callable[[], ChoiceOutput | HarmonyChoiceOutput] = (
            (lambda: HarmonyChoiceOutput(plan)) if fmt.harmony else (lambda: ChoiceOutput(plan, reasoning, trim))
        )
        return await self._respond(gen, req, raw, "chat", f"chatcmpl-{request_id}", remember, make)

    async def render_prompt(
        self, model: ServedModel, messages: list[dict], plan: Any, add_generation_prompt: bool, client_kwargs: dict
    ) -> list[int]:
        """The chat prompt's token ids (tools shown as the plan says), rendered off the event loop; a 400 naming
        messages when the model's template refuses them."""
        shown, template_kwargs = template_inputs(model.tokenizer, messages, plan)
        try:
            return await render_chat(
                model.tokenizer, shown, add_generation_prompt, **{**template_kwargs, **client_kwargs}
            )
        except Exception as exc:  # the model's template refused these messages (its own rules, e.g. roles)
            raise APIError(
                400, f"the model's chat template failed on these messages: {exc}", param="messages"
            ) from None

    def template_kwargs(self, req: ChatCompletionRequest, fmt: ChatFormat) -> dict[str, Any]:
        """The client's chat_template_kwargs (checked) and the reasoning effort, as the model's template reads them."""
        kwargs = checked_template_kwargs(req.chat_template_kwargs, self.trust_request_chat_template)
        if fmt.harmony:
            return harmony_template_kwargs(req.reasoning_effort, kwargs)
        if req.reasoning_effort is not None:
            raise APIError(
                400,
                "reasoning_effort is taken by harmony models (gpt-oss) only; this model's template has none",
                param="reasoning_effort",
            )
        return kwargs

    def chat_format(self, model: ServedModel) -> ChatFormat:
        """The model's tool-call and reasoning formats, found on its first chat request."""
        if model.name not in self.formats:
            self.formats[model.name] = ChatFormat.of(
                model.tokenizer, model.path, self.tools.tool_call_parser, self.reasoning_parser
            )
        return self.formats[model.name]

    async def completion(self, req: CompletionRequest, request_id: str, raw: Request):
        model = self.serving.resolve_model(req.model)
        self.serving.check_capacity(model, request_id)
        prompts = self._prompts(req.prompt)
        if len(prompts) * req.n > MAX_SEQUENCES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} sequences; "
                f"one request may ask for at most {MAX_SEQUENCES}",
                param="n",
            )
        max_tokens = 16 if "max_tokens" not in req.model_fields_set else req.max_tokens  # OpenAI's default
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # echo + logprobs: the prompt's tokens come with theirs
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        params = self.serving.sampling_params(
            req, max_tokens, req.logprobs, prompt_logprobs=prompt_lp, structured_outputs=structured_outputs_params(req)
        )
        self.serving.check_logit_bias(model, params)
        tok = model.tokenizer
        sessions = self.serving.sessions
        session = sessions.find(req.session_id) if req.session_id else None  # made only once the turn succeeds
        if req.session_id and len(prompts) != 1:
            raise APIError(400, "session_id needs exactly one prompt", param="session_id")
        texts = [p if isinstance(p, str) else None for p in prompts]
        history = session.token_ids if session is not None else []
        ids = [
            history + (await encode(tok, p, add_special_tokens=not history) if isinstance(p, str) else p)
            for p in prompts
        ]
        for one in ids:
            self.serving.check_prompt(model, one, max_tokens)
        self.serving.check_logprob_work(model, ids, req.n, max_tokens, req.logprobs, "logprobs")
        gen = await self.serving.start(model, request_id, ids, params, texts if not history else [None])

        def remember(outs) -> None:
            if req.session_id:
                sessions.get(req.session_id).token_ids = ids[0] + list(outs[0].outputs[0].token_ids)

        return await self._respond(gen, req, raw, "text", f"cmpl-{request_id}", remember, None)

    @staticmethod
    def _prompts(prompt) -> list:
        if isinstance(prompt, str):
            return [prompt]
        return [prompt] if isinstance(prompt[0], int) else list(prompt)

    # ---- answering -------------------------------------------------------------------------------
    async def _respond(
        self,
        gen: Generation,
        req,
        raw: Request,
        kind: str,
        response_id: str,
        remember,
        chat_output: Callable[[], ChoiceOutput | HarmonyChoiceOutput] | None,
    ):
        """chat_output: makes each chat choice's parser (reasoning, tool calls); None for text completions."""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(gen, req, kind, response_id, include_usage, remember, chat_output)
            return EventStream(body, background=BackgroundTask(gen.release))
        watcher = asyncio.create_task(abort_on_disconnect(raw, gen))
        try:
            async for _ in gen.outputs():
                pass
        except (RequestFailedError, EngineDeadError) as exc:
            raise _engine_error(exc) from None
        finally:
            watcher.cancel()
            gen.release()
        remember(gen.finals)
        n = req.n
        choices = []
        for i, out in enumerate(gen.finals):
            for c in out.outputs:
                choice = self._choice(kind, i * n + c.index, c, req, 0, 0, final=True)
                if kind == "chat":
                    choice["message"], choice["finish_reason"] = chat_output().message(c.text, c.finish_reason)
                if kind == "text":
                    self._echo(choice, out, gen, req)
                choices.append(choice)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return JSONResponse(
            {
                "id": response_id,
                "object": obj,
                "created": int(time.time()),
                "model": gen.model.name,
                "choices": choices,
                "usage": gen.usage().model_dump(),
            }
        )

    @staticmethod
    def _echo(choice: dict, out: RequestOutput, gen: Generation, req: CompletionRequest) -> None:
        """echo puts the prompt before the text (and its tokens before the logprobs); prompt_logprobs adds vLLM's
        field."""
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
        if not req.echo:
            return
        tok = gen.model.tokenizer
        prompt_text = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
        if req.logprobs is not None:
            first = prompt_completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.logprobs, tok)
            choice["logprobs"] = join_completion_logprobs(first, choice["logprobs"], len(prompt_text))
        choice["text"] = prompt_text + choice["text"]

    async def _stream(
        self,
        gen: Generation,
        req,
        kind: str,
        response_id: str,
        include_usage: bool,
        remember,
        chat_output: Callable[[], ChoiceOutput | HarmonyChoiceOutput] | None,
    ) -> AsyncIterator[str]:
        created, n, hold = int(time.time()), req.n, held_back(req.stop)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        outputs: dict[int, ChoiceOutput | HarmonyChoiceOutput] = {}

        def chunk(choices: list[dict], usage=None) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": response_id,
                        "object": obj,
                        "created": created,
                        "model": gen.model.name,
                        "choices": choices,
                        "usage": usage,
                    }
                )
                + "\n\n"
            )

        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) already streamed
        done: set[int] = set()
        try:
            if kind == "chat":
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(len(gen.prompts) * n)
                    ]
                )
            async for i, out in gen.outputs():
                for c in out.outputs:
                    index = i * n + c.index
                    if index in done:
                        continue
                    start_c, start_t = sent.get(index, (0, 0))
                    end_c = len(c.text) if c.finish_reason else max(start_c, len(c.text) - hold)
                    piece = self._choice(kind, index, c, req, start_c, start_t, final=False, end=end_c)
                    if kind == "text" and index not in sent:
                        self._echo(piece, out, gen, req)
                    reason = c.finish_reason
                    if kind == "chat":
                        parsed = outputs.setdefault(index, chat_output())
                        deltas = parsed.deltas(c.text[:end_c], bool(c.finish_reason), reason)
                        if not deltas and piece["logprobs"]:
                            deltas = [{"content": ""}]
                        for k, delta in enumerate(deltas):  # the step's logprobs go with its first delta
                            yield chunk([{**piece, "delta": delta, "logprobs": piece["logprobs"] if k == 0 else None}])
                        reason = parsed.finish_reason(reason)
                    elif end_c > start_c or piece["logprobs"] or piece.get("text"):
                        yield chunk([piece])
                    sent[index] = (end_c, len(c.token_ids))
                    if c.finish_reason:
                        last = {
                            "index": index,
                            "logprobs": None,
                            "finish_reason": reason,
                            "stop_reason": c.stop_reason,
                            **({"delta": {}} if kind == "chat" else {"text": ""}),
                        }
                        yield chunk([last])
                        done.add(index)
            remember(gen.finals)
            if include_usage:
                yield chunk([], gen.usage().model_dump())
        except (RequestFailedError, EngineDeadError) as exc:
            err = _engine_error(exc)
            yield "data: " + json.dumps(error_body(err.status, err.message, gen.request_id)) + "\n\n"
        finally:
            gen.release()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _choice(
        kind: str, index: int, c: CompletionOutput, req, start_c: int, start_t: int, final: bool, end: int | None = None
    ) -> dict:
        """One choice: whole (final) or the delta from (start_c chars, start_t tokens)."""
        text = c.text[start_c:end]
        lp = None
        if c.logprobs is not None:
            ids, entries = c.token_ids[start_t:], c.logprobs[start_t:]
            lp = (
                chat_logprobs(ids, entries, req.top_logprobs or 0)
                if kind == "chat"
                else completion_logprobs(ids, entries, req.logprobs or 0, start_c)
            )
        if kind == "chat":
            body = {
                "message" if final else "delta": {"role": "assistant", "content": text} if final else {"content": text}
            }
        else:
            body = {"text": text}
        choice = {"index": index, **body, "logprobs": lp}
        if final:
            choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        else:
            choice["finish_reason"] = None
        return choice


def _engine_error(exc: Exception) -> APIError:
    """503 when the engine loop is gone, 500 when only this request's step failed."""
    return APIError(503 if isinstance(exc, EngineDeadError) else 500, str(exc))

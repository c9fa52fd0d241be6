"""What chat and text completions share: model routing, sampling parameters, prompt checks, admission,
submitting to the engine, merging streams, usage, and aborting on client disconnect."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request

from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams
from novainfer.server.async_engine import AsyncEngineBase, DuplicateRequestError, EngineDeadError, TrackedRequest
from novainfer.server.errors import APIError
from novainfer.server.limits import AdmissionLimiter, OverloadedError, Slot
from novainfer.server.protocol import MAX_LOGPROB_ENTRIES, SamplingFields, UsageInfo
from novainfer.server.sessions import SessionStore

_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class ServedModel:
    """One model the server answers for: its engine, and a tokenizer for the event loop's use."""

    name: str
    path: str
    engine: AsyncEngineBase
    tokenizer: Any
    max_model_len: int

    @classmethod
    def create(cls, name: str, engine: AsyncEngineBase) -> "ServedModel":
        return cls(name, engine.model_path, engine, engine.tokenizer, engine.max_model_len)


def engine_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine's request id for each prompt of one HTTP request."""
    return [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]


class Generation:
    """One admitted HTTP request's engine requests (one per prompt), released exactly once."""

    def __init__(self, model: ServedModel, request_id: str, prompts: list[list[int]], slot: Slot):
        self.model, self.request_id, self.prompts, self.slot = model, request_id, prompts, slot
        self.sub_ids = engine_request_ids(request_id, len(prompts))
        self.finals: list[RequestOutput | None] = [None] * len(prompts)
        self.tracked: list[TrackedRequest] = []  # the engine requests this generation submitted (and releases)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) from every engine request, as they arrive."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request_id: str) -> None:
            try:
                async for out in self.model.engine.stream(request_id):
                    merged.put_nowait((i, out))
            except Exception as exc:  # a failed request; cancellation (the consumer left) propagates
                merged.put_nowait((i, exc))
                return
            merged.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(self.sub_ids)]
        try:
            for _ in range(len(tasks)):
                while True:
                    i, item = await merged.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    self.finals[i] = item
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    def usage(self) -> UsageInfo:
        outs = [o for o in self.finals if o is not None]
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )

    def release(self) -> None:
        """Abort whatever still runs (client gone, error) and give the admission slot back."""
        for tracked in self.tracked:
            self.model.engine.release(tracked)
        self.slot.release()


class OpenAIServing:
    """Routes requests to served models and runs them under the admission limits."""

    def __init__(self, models: list[ServedModel], limiter: AdmissionLimiter, sessions: SessionStore):
        self.models = {m.name: m for m in models}
        self.limiter = limiter
        self.sessions = sessions
        self.draining = False  # set on SIGTERM: new generations get 503

    def begin_drain(self, timeout: float) -> None:
        """Refuse new generations from now on; abort the ones still running after `timeout` seconds."""
        self.draining = True
        asyncio.get_running_loop().call_later(timeout, self.abort_all)

    def abort_all(self) -> None:
        """Cancel every live request of every model (their streams end with finish_reason "abort")."""
        for m in self.models.values():
            m.engine.cancel_all()

    def check_capacity(self, model: ServedModel, request_id: str) -> None:
        """429 at once when every slot and queue place is taken: before the prompt is rendered or tokenized. A
        duplicate of a running request's id is the client's error whatever the load: its 409 comes first."""
        if model.engine.in_use(request_id) or model.engine.in_use(f"{request_id}-0"):
            raise self._duplicate(request_id)
        try:
            self.limiter.check()
        except OverloadedError as exc:
            raise self._overloaded(exc) from None

    @staticmethod
    def _overloaded(exc: OverloadedError) -> APIError:
        return APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)})

    def check_available(self, model: ServedModel) -> None:
        """503 while the server shuts down or when the model's engine loop has died."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down")
        if model.engine.is_dead:
            raise APIError(503, f"the engine for {model.name} died: {model.engine.dead_reason}")

    def resolve_model(self, name: str | None) -> ServedModel:
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Served models: {', '.join(self.models)}",
                param="model",
                code="model_not_found",
            )
        return self.models[name]

    @staticmethod
    def sampling_params(
        req: SamplingFields, max_tokens: int | None, logprobs: int | None, **extra: Any
    ) -> SamplingParams:
        """SamplingParams from the request (extra: what the endpoint decides, e.g. structured_outputs,
        prompt_logprobs); its ValueError (naming the field) becomes a 400."""
        kw: dict[str, Any] = {name: getattr(req, name) for name in _OPTIONAL_SAMPLING if getattr(req, name) is not None}
        try:
            return SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                logit_bias=req.logit_bias,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                **kw,
                **extra,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    @staticmethod
    def check_logit_bias(model: ServedModel, params: SamplingParams) -> None:
        """400 for a logit_bias key or stop_token_ids entry outside the vocabulary (either would be a silent
        no-op)."""
        vocab = len(model.tokenizer)
        for param, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise APIError(400, f"{param} token ids must be in [0, {vocab}), got {bad[0]}", param=param)

    @staticmethod
    def check_prompt(model: ServedModel, prompt_ids: list[int], max_tokens: int | None) -> None:
        """400 for an empty prompt or one that leaves no room (within max_model_len) for the completion."""
        n, limit = len(prompt_ids), model.max_model_len
        if n == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if n >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {n} tokens, which leaves no room for the completion.",
                param="prompt",
            )
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion).",
                param="max_tokens",
            )

    def check_unused(self, model: ServedModel, request_id: str, num_prompts: int) -> None:
        """409 (before admission) when a running request already has this X-Request-Id."""
        if any(model.engine.in_use(i) for i in engine_request_ids(request_id, num_prompts)):
            raise self._duplicate(request_id)

    @staticmethod
    def _duplicate(request_id: str) -> APIError:
        return APIError(
            409,
            f"X-Request-Id {request_id!r} is already used by a running request; send a unique id (or none)",
            param="X-Request-Id",
            code="duplicate_request_id",
        )

    @staticmethod
    def check_logprob_work(
        model: ServedModel, prompts: list[list[int]], n: int, max_tokens: int | None, logprobs: int | None, param: str
    ) -> None:
        """400 when sequences x completion tokens x logprobs per token passes MAX_LOGPROB_ENTRIES (the response
        would hold that many entries)."""
        if not logprobs:
            return
        tokens = sum(max_tokens if max_tokens is not None else model.max_model_len - len(p) for p in prompts)
        entries = tokens * n * (logprobs + 1)  # the sampled token's own entry too
        if entries > MAX_LOGPROB_ENTRIES:
            raise APIError(
                400,
                f"n={n} x {tokens} completion tokens x ({logprobs} + 1) logprobs is {entries} "
                f"logprob entries; one request may ask for at most {MAX_LOGPROB_ENTRIES}",
                param=param,
            )

    async def start(
        self,
        model: ServedModel,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_texts: list[str | None],
    ) -> Generation:
        """Admit (429 past the limits) and submit every prompt; on any refusal nothing stays queued."""
        self.check_available(model)
        self.check_unused(model, request_id, len(prompts))
        try:
            slot = await self.limiter.acquire()
        except OverloadedError as exc:
            raise self._overloaded(exc) from None
        gen = Generation(model, request_id, prompts, slot)
        try:
            self.check_available(model)  # the drain may have begun while this request waited for its slot
            for rid, ids, text in zip(gen.sub_ids, prompts, prompt_texts):
                gen.tracked.append(
                    await model.engine.submit(rid, {"prompt": text, "prompt_token_ids": ids}, params, group=request_id)
                )
        except BaseException as exc:
            gen.release()
            if isinstance(exc, DuplicateRequestError):
                raise self._duplicate(request_id) from None
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc)) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc)) from None
            raise
        return gen


async def abort_on_disconnect(raw_request: Request, gen: Generation, interval: float = 0.1) -> None:
    """Poll the connection of a non-streaming request; cancel its generation when the client leaves."""
    while not await raw_request.is_disconnected():
        await asyncio.sleep(interval)
    await gen.model.engine.cancel(gen.request_id)


def held_back(stop: list[str] | None) -> int:
    """Characters a stream keeps back while unfinished, since they may still become a (trimmed) stop string."""
    return max((len(s) for s in stop or []), default=1) - 1

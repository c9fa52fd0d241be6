"""OutputProcessor: the front-end's half of a step. It applies the core's new token ids to each request:
incremental detokenization, stop strings (a hit is returned as a sample for the core to abort, so its
blocks are freed at once), logprob formatting, and RequestOutput assembly."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from novainfer.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from novainfer.engine.messages import AbortTarget, EngineCoreOutput
from novainfer.outputs import CompletionOutput, Logprob, RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass
class SampleState:
    """One of a request's n samples as the front-end sees it."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    spec_num_draft_tokens: int = 0  # speculative decoding: guesses verified for this sample, and accepted
    spec_num_accepted_tokens: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    arrival_time: float
    status: RequestStatus = RequestStatus.QUEUED
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list | None = None  # one entry per prompt token (the first None) when params ask for them
    final_only: bool = False  # params.output_kind is FINAL_ONLY: nobody reads an output before the end
    text_deferred: bool = False  # final_only and no stop strings: the text is decoded once, at the end

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Per-request text state, fed with each step's EngineCoreOutputs."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        samples = [
            SampleState(
                i,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
                ),
            )
            for i in range(params.n)
        ]
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self.requests[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            samples,
            arrival_time,
            prompt_logprobs=[None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None,
            final_only=final_only,
            text_deferred=final_only and not params.stop,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request; its final output (finish_reason "abort"), or None when it is unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for s in req.samples:
            s.finish_reason = s.finish_reason or "abort"
        req.status = RequestStatus.CANCELLED
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[AbortTarget]]:
        """The outputs of requests that advanced, and the samples (or requests) the core must abort.

        The common output (new tokens of a request whose text nobody reads before its end, no logprobs) only
        extends the sample's token ids; its text is decoded once, when the request finishes."""
        touched: dict[str, RequestState] = {}
        ended: set[str] = set()  # requests a sample of which ended in this batch
        failed: list[RequestOutput] = []
        to_abort: list[AbortTarget] = []
        now = time.monotonic()
        requests = self.requests
        for out in core_outputs:
            rid = out.request_id
            req = requests.get(rid)
            if req is None:  # aborted here while the core was stepping, or failed earlier in this batch
                continue
            if out.error is not None:
                failed.append(self._fail(req, out.error))
                touched.pop(rid, None)
                continue
            samples = req.samples
            if not 0 <= out.index < len(samples):
                logger.warning("request_id=%s output for sample %d of %d dropped", rid, out.index, len(samples))
                continue
            if out.prompt_logprobs is not None:  # a prefill chunk's prompt logprobs (no new token)
                self._add_prompt_logprobs(req, *out.prompt_logprobs)
                if not req.final_only:
                    touched[rid] = req
                continue
            sample = samples[out.index]
            if sample.finish_reason is not None:  # a stop string ended it; the core had not heard yet
                continue
            req.status = RequestStatus.RUNNING
            if req.first_token_time is None:
                req.first_token_time = now
            req.num_cached_tokens, sample.num_preemptions = out.num_cached_tokens, out.num_preemptions
            if out.spec_num_draft_tokens:
                sample.spec_num_draft_tokens = out.spec_num_draft_tokens
                sample.spec_num_accepted_tokens = out.spec_num_accepted_tokens
            if req.text_deferred and out.new_logprobs is None:
                sample.token_ids += out.new_token_ids
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            else:
                try:
                    if self._apply(req, sample, out):
                        to_abort.append(AbortTarget(rid, out.index))
                except Exception as exc:  # detokenizing broke on this request: fail it alone
                    logger.exception("request_id=%s failed while applying its tokens", rid)
                    failed.append(self._fail(req, f"{type(exc).__name__}: {exc}"))
                    to_abort.append(AbortTarget(rid))
                    touched.pop(rid, None)
                    continue
            if sample.finish_reason is not None:
                ended.add(rid)
            touched[rid] = req
        outputs = failed
        for rid, req in touched.items():
            if rid not in ended or not req.finished:
                if not req.final_only:
                    outputs.append(self._make_output(req))
                continue
            req.status = RequestStatus.FINISHED
            del requests[rid]
            outputs.append(self._make_output(req))
        return outputs, to_abort

    def _apply(self, req: RequestState, sample: SampleState, out: EngineCoreOutput) -> bool:
        """Add the new tokens' text and logprobs; True when a stop string ended the sample here (the core
        still runs it and must abort it)."""
        p = req.params
        detok = sample.detokenizer
        for i, token_id in enumerate(out.new_token_ids):
            sample.token_ids.append(token_id)
            # nobody reads the text before the end: decoded once then (flush)
            new_text = "" if req.text_deferred else detok.step([token_id])
            top = out.new_logprobs[i] if out.new_logprobs else None
            if top:
                sample.cumulative_logprob += top[0][1]
                sample.logprobs.append({tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in top})
            if p.stop and out.finish_reason != "stop" and len(sample.token_ids) >= p.min_tokens:
                hit = check_stop_strings(detok.output_text, len(new_text), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    detok.output_text = detok.output_text[: hit[1]]
                    sample.finish_reason, sample.stop_reason = "stop", hit[0]
                    return out.finish_reason is None
        sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _add_prompt_logprobs(self, req: RequestState, start: int, entries: list) -> None:
        """Store a chunk's prompt logprobs by position (a chunk recomputed after preemption changes nothing)."""
        if req.prompt_logprobs is None:
            return
        for pos, entry in enumerate(entries, start + 1):
            if pos < len(req.prompt_logprobs) and req.prompt_logprobs[pos] is None:
                req.prompt_logprobs[pos] = {
                    tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in entry
                }

    def _fail(self, req: RequestState, error: str) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        req.status, req.error = RequestStatus.FAILED, error
        for s in req.samples:
            s.finish_reason = s.finish_reason or "error"
        return self._make_output(req)

    def _make_output(self, req: RequestState) -> RequestOutput:
        want_lp = req.params.logprobs is not None
        completions = []
        finished = True
        for s in req.samples:
            if s.finish_reason is None:
                finished = False
            elif not isinstance(s.stop_reason, str):  # a stop string already cut it
                s.detokenizer.flush(s.token_ids)
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.output_text,
                    token_ids=list(s.token_ids),
                    cumulative_logprob=s.cumulative_logprob if want_lp else None,
                    logprobs=list(s.logprobs) if want_lp else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        samples = req.samples
        preemptions = samples[0].num_preemptions if len(samples) == 1 else sum(s.num_preemptions for s in samples)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            completions,
            finished,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            metrics={
                "arrival_time": req.arrival_time,
                "first_token_time": req.first_token_time,
                "num_preemptions": preemptions,
                "spec_num_draft_tokens": sum(s.spec_num_draft_tokens for s in req.samples),
                "spec_num_accepted_tokens": sum(s.spec_num_accepted_tokens for s in req.samples),
            },
        )

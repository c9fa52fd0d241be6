"""LLMEngine: turns requests into sequences, drives scheduler and executor one step at a time,
and turns sampled tokens back into text and finished outputs."""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from novainfer.config import EngineConfig
from novainfer.engine.block_manager import BlockManager
from novainfer.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from novainfer.engine.faults import FaultInjector, RequestError
from novainfer.engine.scheduler import Scheduler
from novainfer.engine.sequence import Sequence
from novainfer.executor.base import Executor
from novainfer.loader.model_loader import eos_token_ids, load_hf_config, load_tokenizer, resolve_model_path
from novainfer.outputs import CompletionOutput, Logprob, RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams
from novainfer.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float
    status: RequestStatus = RequestStatus.QUEUED
    first_token_time: float | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list | None = None  # one entry per prompt token (the first None) when params ask for them

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        mc = config.model_config
        mc.model = resolve_model_path(mc.model)
        mc.hf_config = load_hf_config(mc.model)
        self.config = config
        self.tokenizer = load_tokenizer(mc.tokenizer or mc.model)
        self.eos_token_ids = eos_token_ids(mc.model, mc.hf_config, self.tokenizer)
        self.executor = Executor.get_class(config)(config, mc.hf_config)
        num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
        self.executor.collective_rpc("initialize_cache", num_blocks)
        bs = config.cache_config.block_size
        self.max_model_len = self._resolve_max_model_len(num_blocks * bs)
        self.block_manager = BlockManager(num_blocks, bs, config.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.faults = FaultInjector(config.fault_injection)
        self.structured_output = StructuredOutputManager(self.tokenizer, mc.hf_config.vocab_size,
                                                         self.eos_token_ids)
        self.step_id = 0
        self.num_generated_tokens = 0
        logger.info("engine ready: model=%s blocks=%d (%d tokens) max_model_len=%d",
                    mc.model, num_blocks, num_blocks * bs, self.max_model_len)

    def shutdown(self) -> None:
        """Stop the executor's workers (processes with the mp backend)."""
        self.executor.shutdown()

    def _resolve_max_model_len(self, cache_tokens: int) -> int:
        mc = self.config.model_config
        model_max = mc.hf_config.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > model_max:
            raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max}")
        wanted = mc.max_model_len or model_max
        if wanted > cache_tokens:
            if mc.max_model_len is not None:
                raise ValueError(f"max_model_len={wanted} needs more KV cache than fits ({cache_tokens} tokens); "
                                 "lower max_model_len or give the cache more memory")
            logger.warning("max_model_len lowered from %d to the KV cache's %d tokens", wanted, cache_tokens)
            wanted = cache_tokens
        return wanted

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request; an unservable one raises ValueError before anything is queued."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        grammar = self.structured_output.compile(params.structured_outputs) if params.structured_outputs else None
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        vocab = self.config.model_config.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        now = time.monotonic() if arrival_time is None else arrival_time
        blocked: list[int] = []  # ids that may not end the output before min_tokens
        if params.min_tokens > 0:
            blocked = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
        seqs, detoks = [], []
        for i in range(params.n):
            seq = Sequence(token_ids, params, request_id, index=i, arrival_time=now)
            seq.min_tokens_blocked = list(blocked)
            if grammar is not None:
                seq.grammar = self.structured_output.new_state(grammar)
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                                 params.spaces_between_special_tokens))
        self.requests[request_id] = Request(request_id, text, token_ids, params, seqs, detoks, now,
                                            prompt_logprobs=[None] * len(token_ids)
                                            if params.prompt_logprobs is not None else None)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output (finish_reason abort)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        req.status = RequestStatus.CANCELLED
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, and apply one step; returns outputs of requests that advanced."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.step_id += 1
        if logger.isEnabledFor(logging.DEBUG):
            decode = sum(s.num_new_tokens for s in sched.scheduled
                         if s.seq.num_computed_tokens >= s.seq.num_prompt_tokens)
            logger.debug("step_id=%d batch_size=%d num_prefill_tokens=%d num_decode_tokens=%d preempted=%d",
                         self.step_id, len(sched.scheduled), sched.num_tokens - decode, decode, sched.num_preempted)
        sched.grammar_bitmask = self.structured_output.grammar_bitmask(
            [s.seq for s in sched.scheduled if s.samples])
        try:
            result = self.executor.execute_model(sched)
        except RequestError as exc:  # one request's fault: it fails alone, the others run again
            return self._fail_request_in_step(sched, exc)
        except Exception as exc:
            self._fail_step(sched, exc)
            raise
        self.scheduler.on_step_done(sched.scheduled)
        self.num_generated_tokens += len(result.sampled_token_ids)
        by_seq = {s.seq.seq_id: s.seq for s in sched.scheduled}
        touched: dict[str, Request] = {}
        if result.prompt_logprobs:
            self._add_prompt_logprobs(by_seq, result.prompt_logprobs, touched)
        outputs = []
        now = time.monotonic()
        faults = self.faults if self.faults else None
        for row, (seq_id, token_id) in enumerate(zip(result.seq_ids, result.sampled_token_ids)):
            seq = by_seq[seq_id]
            req = self.requests.get(seq.request_id)
            if req is None:  # failed earlier in this step (another of its samples)
                continue
            req.status = RequestStatus.RUNNING
            req.first_token_time = req.first_token_time or now
            try:
                if faults is not None:
                    faults.check("postprocess", req.request_id)
                self._append_token(req, seq, token_id, result.logprobs[row] if result.logprobs else None)
            except Exception as exc:  # detokenizing or stop checks broke on this request: fail it alone
                logger.exception("request_id=%s failed while applying its token", req.request_id)
                self._fail_request(req, exc)
                outputs.append(self._make_output(req))
                touched.pop(req.request_id, None)
                continue
            touched[req.request_id] = req
        for req in touched.values():
            if not req.finished:
                if req.params.output_kind != RequestOutputKind.FINAL_ONLY:
                    outputs.append(self._make_output(req))
                continue
            req.status = RequestStatus.FINISHED
            del self.requests[req.request_id]
            outputs.append(self._make_output(req))
        return outputs

    def _add_prompt_logprobs(self, by_seq: dict, chunks: dict, touched: dict) -> None:
        """Store a step's prompt logprobs by position (a recomputed chunk, after preemption, changes nothing)."""
        for seq_id, (start, entries) in chunks.items():
            req = self.requests.get(by_seq[seq_id].request_id)
            if req is None or req.prompt_logprobs is None:
                continue
            for pos, entry in enumerate(entries, start + 1):
                if req.prompt_logprobs[pos] is None:
                    req.prompt_logprobs[pos] = {tid: Logprob(lp, rank, self.tokenizer.decode([tid]))
                                                for tid, lp, rank in entry}
            if req.params.output_kind != RequestOutputKind.FINAL_ONLY:
                touched[req.request_id] = req

    def _fail_request(self, req: Request, exc: Exception) -> None:
        """End one request with finish_reason "error" and free its blocks; its output will carry the error."""
        self.requests.pop(req.request_id, None)
        req.status, req.error = RequestStatus.FAILED, f"{type(exc).__name__}: {exc}"
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)

    def _fail_request_in_step(self, sched, exc: RequestError) -> list[RequestOutput]:
        """The step did not complete because of one request: fail it; the other sequences go back to
        the queue to be recomputed (their KV for this step may be missing), and the prefix cache, which
        registered this step's blocks when it was planned, is dropped."""
        logger.error("step %d failed for request_id=%s: %s", self.step_id, exc.request_id, exc)
        req = self.requests.get(exc.request_id)
        if req is None:  # not a request of this engine: nothing to single out
            self._fail_step(sched, exc)
            raise exc
        self._fail_request(req, exc)
        for s in reversed(sched.scheduled):  # each goes to the queue's head: keep their order
            if not s.seq.is_finished:
                self.scheduler.requeue(s.seq)
        self.block_manager.reset_prefix_cache()
        return [self._make_output(req)]

    def _fail_step(self, sched, exc: Exception) -> None:
        """A step that raised: its requests fail, and cached blocks it wrote can't be trusted."""
        logger.exception("step %d failed", self.step_id)
        for s in sched.scheduled:
            req = self.requests.get(s.seq.request_id)
            if req is not None:
                self._fail_request(req, exc)
        self.block_manager.reset_prefix_cache()

    def _append_token(self, req: Request, seq: Sequence, token_id: int, logprobs) -> None:
        p = seq.sampling_params
        seq.append_token(token_id)
        if seq.grammar is not None:
            self.structured_output.accept(seq.grammar, seq.output_token_ids)
        detok = req.detokenizers[seq.index]
        if p.stop or p.output_kind != RequestOutputKind.FINAL_ONLY:
            new_text = detok.step([token_id])
        else:  # nobody reads the text before the end: decode it once then
            detok.defer(token_id)
            new_text = ""
        if logprobs:
            seq.cumulative_logprob += logprobs[0][1]
            seq.logprobs.append({tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in logprobs})
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            seq.min_tokens_blocked = []
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self._finish(seq, "stop", None)
                return
            if p.stop_token_ids and token_id in p.stop_token_ids:
                self._finish(seq, "stop", token_id)
                return
            if p.stop:
                hit = check_stop_strings(detok.output_text, len(new_text), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    detok.output_text = detok.output_text[:hit[1]]
                    self._finish(seq, "stop", hit[0])
                    return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _make_output(self, req: Request) -> RequestOutput:
        completions = []
        for seq, detok in zip(req.seqs, req.detokenizers):
            if seq.is_finished and not isinstance(seq.stop_reason, str):  # a stop string already cut the text
                detok.flush()
            want_lp = req.params.logprobs is not None
            completions.append(CompletionOutput(
                index=seq.index, text=detok.output_text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                logprobs=list(seq.logprobs) if want_lp else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, req.finished,
                             num_cached_tokens=req.seqs[0].num_cached_tokens, error=req.error,
                             prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                             metrics={"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                                      "num_preemptions": sum(s.num_preemptions for s in req.seqs)})

"""EngineCore: the scheduler, the block manager and the executor, and one step of the engine.

A step has three phases, each a method: schedule (which sequences run, how many tokens), execute (the
executor runs the model and samples), update_from_output (token-level bookkeeping: append each sampled
token, finish on eos, a stop token id, max_tokens or the context's end). The core never tokenizes or
detokenizes: it takes token ids and returns, per sample, the new token ids and how it ended. Stop strings,
text and logprob formatting belong to the front-end (engine/output_processor.py). It runs in the caller's
process (LLMEngine) or in a process of its own (engine/core_proc.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from novainfer.config import EngineConfig
from novainfer.engine.faults import RequestError
from novainfer.engine.kv_events import publisher_for
from novainfer.engine.messages import (
    AbortTarget,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from novainfer.engine.processor import check_request
from novainfer.engine.scheduler import Scheduler
from novainfer.engine.state_slots import make_block_manager
from novainfer.executor import get_executor_class
from novainfer.loader.model_loader import load_tokenizer
from novainfer.sequence import Sequence, SequenceStatus
from novainfer.spec_decode import make_proposer
from novainfer.spec_decode.stats import SpecDecodeStats
from novainfer.step_types import ModelRunnerOutput, SchedulerOutput, StepFuture
from novainfer.structured_output import StructuredOutputManager
from novainfer.worker.kv_layout import worker_kv_layout
from novainfer.worker.state_cache import worker_num_state_slots

logger = logging.getLogger(__name__)
FINISHED = SequenceStatus.FINISHED


@dataclass
class Request:
    """The core's view of a request: its n samples' sequences."""

    request_id: str
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class EngineCore:
    """Owns the KV cache's bookkeeping and the workers; `step()` advances every scheduled sequence."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        config = config.with_token_budget()  # before the executor's step buffers are sized
        mc = config.model_config  # model path resolved and hf_config loaded by the caller
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = mc.hf_config.vocab_size
        self.executor = get_executor_class(config)(config, mc.hf_config)
        self.num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
        self.executor.collective_rpc("initialize_cache", self.num_blocks)
        bs = config.cache_config.block_size
        kv_layout = self.executor.collective_rpc(worker_kv_layout)[0]  # ranks split heads, not layers: one layout
        cache_tokens = self.num_blocks * bs if kv_layout is None else kv_layout.max_context(self.num_blocks)
        if cache_tokens is None:  # every layer slides: any context fits
            cache_tokens = mc.hf_config.max_position_embeddings
        self.max_model_len = resolve_max_model_len(config, cache_tokens)
        self.block_manager = make_block_manager(
            config, mc.hf_config, self.num_blocks, self.executor.collective_rpc(worker_num_state_slots), kv_layout
        )
        spec = config.speculative_config
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.block_manager,
            spec.num_lookahead_slots if spec is not None else 0,
            mixed_steps=not config.batch_invariant,
        )
        self.proposer = make_proposer(spec, self.executor) if spec is not None else None
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        # with CUDA graphs, a proposer's short guess lists are filled up by repeating the last token (checked like
        # any guess), so verify steps have one shape and replay a captured graph instead of running eagerly
        self.fill_guesses = config.resolve_device().type == "cuda" and not config.enforce_eager
        self.spec_stats = SpecDecodeStats()
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.num_generated_tokens = 0
        self._failed: list[EngineCoreOutput] = []  # outputs of requests a raising step failed
        self.async_scheduling = config.use_async_scheduling()
        self.structured_output = StructuredOutputManager(
            lambda: load_tokenizer(mc.tokenizer or mc.model), self.vocab_size, self.eos_token_ids
        )
        self._inflight: InFlightStep | None = None  # with async scheduling: the launched step not yet read back
        self.kv_events = publisher_for(config)  # None unless --kv-events-config enables them (engine/kv_events.py)
        if self.kv_events is not None:
            self.block_manager.kv_events = []
        logger.info(
            "engine core ready: model=%s blocks=%d (%d tokens of one sequence's context) max_model_len=%d "
            "async_scheduling=%s",
            mc.model,
            self.num_blocks,
            cache_tokens,
            self.max_model_len,
            self.async_scheduling,
        )

    def shutdown(self) -> None:
        """Stop the executor's workers (processes with the mp backend) and free their caches; a launched step
        nobody will read is waited for first."""
        if self._inflight is not None:
            try:
                self._inflight.handle.get()
            except Exception:  # noqa: BLE001 - its outcome is dropped either way
                logger.debug("in-flight step failed at shutdown", exc_info=True)
            self._inflight = None
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request; ValueError (nothing queued) when it cannot be served."""
        rid, params = request.request_id, request.sampling_params
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        check_request(request.prompt_token_ids, params, self.max_model_len, self.vocab_size)
        grammar = self.structured_output.compile(params.structured_outputs) if params.structured_outputs else None
        blocked: list[int] = []  # ids that may not end the output before min_tokens
        if params.min_tokens > 0:
            blocked = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
        seqs = []
        for i in range(params.n):
            seq = Sequence(request.prompt_token_ids, params, rid, index=i, arrival_time=request.arrival_time)
            seq.min_tokens_blocked = list(blocked)
            if grammar is not None:
                seq.grammar = self.structured_output.new_state(grammar, params.structured_outputs.after_tokens)
            seqs.append(seq)
        self.requests[rid] = Request(rid, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_requests(self, targets: list[AbortTarget]) -> None:
        """Free the blocks of cancelled requests, or of single samples a stop string ended; unknown ids
        (requests that already finished) are ignored."""
        for target in targets:
            req = self.requests.get(target.request_id)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished and target.index in (None, seq.index):
                    self._finish(seq, "abort", None)
            if req.finished:
                del self.requests[target.request_id]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a launched step still to read back."""
        return bool(self.requests) or self._inflight is not None

    def make_stats(self) -> SchedulerStats:
        sched, bm = self.scheduler, self.block_manager
        sp = self.spec_stats
        return SchedulerStats(
            len({s.request_id for s in sched.running}),
            len({s.request_id for s in sched.waiting}),
            bm.usage,
            bm.num_prefix_queries,
            bm.num_prefix_hits,
            sched.num_preemptions,
            self.num_generated_tokens,
            sp.num_drafts,
            sp.num_draft_tokens,
            sp.num_accepted_tokens,
            sp.num_emitted_tokens,
        )

    # ---- one step: schedule -> execute -> update_from_output -------------------------------------
    def step(self) -> EngineCoreOutputs | None:
        """One step; None when nothing ran or was read back. A step that raises (not because of one request)
        has failed its requests first: pop_failed_outputs() has their outputs.

        With async scheduling the step launched here is read back by the next call: the host plans and
        launches step N+1 while step N runs, and step N's tokens are applied one step late."""
        if self.async_scheduling:
            return self._step_overlapped()
        sched = self.schedule()
        if sched.is_empty:
            return None
        try:
            result = self.execute(sched)
        except Exception as exc:
            outputs = self._fail_step_of(sched, exc)
        else:
            outputs = self.update_from_output(sched, result)
        self._publish_kv_events()
        return EngineCoreOutputs(outputs, self.make_stats(), time.monotonic())

    def _step_overlapped(self) -> EngineCoreOutputs | None:
        outputs: list[EngineCoreOutput] = []
        if self._inflight is not None and self._inflight.needs_sync:  # its tokens shape the next step's sampling
            outputs += self._read_back(self._inflight, None)
            self._inflight = None
        sched = self.schedule()
        launched = None
        if not sched.is_empty:
            try:
                launched = InFlightStep(sched, self.executor.execute_model_async(sched))
            except Exception as exc:  # preparing the step failed: finish the one before, then fail this one
                if self._inflight is not None:
                    outputs += self._read_back(self._inflight, None)
                    self._inflight = None
                outputs += self._fail_step_of(sched, exc)
        prev, self._inflight = self._inflight, launched
        if prev is not None:
            outputs += self._read_back(prev, launched)
        if prev is None and launched is None and not outputs:
            return None
        self._publish_kv_events()
        return EngineCoreOutputs(outputs, self.make_stats(), time.monotonic())

    def _publish_kv_events(self) -> None:
        """Hand the step's prefix-cache changes to the publisher as one batch."""
        events = self.block_manager.kv_events
        if events:
            self.kv_events.publish(events)
            self.block_manager.kv_events = []

    def _read_back(self, step: "InFlightStep", next_step: "InFlightStep | None") -> list[EngineCoreOutput]:
        """Wait for a launched step and apply its tokens. If it failed, the step launched after it (which
        continued its sequences from KV that can't be trusted) is discarded and recomputed first."""
        try:
            result = step.handle.get()
        except Exception as exc:
            if next_step is not None and self._inflight is next_step:
                self._discard(next_step)
                self._inflight = None
            return self._fail_step_of(step.sched, exc)
        return self.update_from_output(step.sched, result)

    def _discard(self, step: "InFlightStep") -> None:
        """Drop a launched step's results: wait for it, then its sequences go back to be recomputed."""
        try:
            step.handle.get()
        except Exception:  # noqa: BLE001 - its outcome is dropped either way
            logger.debug("discarded step failed too", exc_info=True)
        self.scheduler.undo_step(step.sched.scheduled)
        for s in reversed(step.sched.scheduled):
            if not s.seq.is_finished:
                self.scheduler.requeue(s.seq)

    def _fail_step_of(self, sched: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """A step that did not complete: one request's fault fails it alone (the others run again);
        anything else fails the step's requests and is raised."""
        self.scheduler.undo_step(sched.scheduled)
        if isinstance(exc, RequestError):
            return self._fail_request_in_step(sched, exc)
        self._fail_step(sched, exc)
        raise exc

    def schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self.step_id += 1
            sched.grammar_bitmask = self.structured_output.grammar_bitmask(
                [s.seq for s in sched.scheduled if s.samples]
            )
            if logger.isEnabledFor(logging.DEBUG):
                decode = sum(s.num_new_tokens for s in sched.scheduled if s.start >= s.seq.num_prompt_tokens)
                logger.debug(
                    "step_id=%d batch_size=%d num_prefill_tokens=%d num_decode_tokens=%d preempted=%d",
                    self.step_id,
                    len(sched.scheduled),
                    sched.num_tokens - decode,
                    decode,
                    sched.num_preempted,
                )
        return sched

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.executor.execute_model(sched)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append each sampled token to its sequence and finish the sequences that ended at the token level."""
        by_seq = {s.seq.seq_id: s.seq for s in sched.scheduled}
        outputs: list[EngineCoreOutput] = []
        for seq_id, (start, entries) in (
            result.prompt_logprobs or {}
        ).items():  # ids and logprobs; text is the front-end's
            seq = by_seq[seq_id]
            if seq.request_id in self.requests:
                outputs.append(EngineCoreOutput(seq.request_id, seq.index, prompt_logprobs=[start, entries]))
        if result.spec_accepted_token_ids is not None:
            return outputs + self._update_verified(sched, result, by_seq)
        for row, (seq_id, token_id) in enumerate(zip(result.seq_ids, result.sampled_token_ids)):
            seq = by_seq[seq_id]
            rid = seq.request_id
            if seq.status is FINISHED or rid not in self.requests:  # finished before this step was read back
                continue  # (its token is the overlap's extra one), failed earlier in this step, or aborted
            try:
                self._append_token(seq, token_id)
            except Exception as exc:  # this request's bookkeeping broke: fail it alone
                logger.exception("request_id=%s failed while applying its token", rid)
                outputs.append(self._fail_request(rid, exc))
                continue
            outputs.append(
                EngineCoreOutput(
                    rid,
                    seq.index,
                    [token_id],
                    [result.logprobs[row]] if result.logprobs else None,
                    seq.finish_reason,
                    seq.stop_reason,
                    seq.num_cached_tokens,
                    seq.num_preemptions,
                )
            )
            if seq.is_finished and self.requests[rid].finished:
                del self.requests[rid]
        if self.proposer is not None:
            self._propose(sched)
        return outputs

    def _update_verified(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, by_seq: dict
    ) -> list[EngineCoreOutput]:
        """A verify step: each sequence appends its accepted guesses and the token after them, stopping at the
        first token that ends it (nothing past it is returned); rejected guesses' KV is given back."""
        outputs: list[EngineCoreOutput] = []
        spec_of = {s.seq.seq_id: len(s.spec_token_ids) for s in sched.scheduled}
        for row, (seq_id, token_id) in enumerate(zip(result.seq_ids, result.sampled_token_ids)):
            seq = by_seq[seq_id]
            rid = seq.request_id
            if seq.is_finished or rid not in self.requests:
                continue
            accepted = result.spec_accepted_token_ids[row]
            tokens = accepted + [token_id]
            logprobs = result.spec_logprobs[row] + [result.logprobs[row]] if result.logprobs else None
            drafted, proposed = spec_of[seq_id], len(seq.spec_token_ids)
            try:
                emitted = 0
                for t in tokens:
                    self._append_token(seq, t)
                    emitted += 1
                    if seq.is_finished:
                        break
            except Exception as exc:
                logger.exception("request_id=%s failed while applying its tokens", rid)
                outputs.append(self._fail_request(rid, exc))
                continue
            if drafted:
                self.spec_stats.record(drafted, len(accepted), emitted)
                seq.num_spec_draft_tokens += drafted
                seq.num_spec_accepted_tokens += len(accepted)
            if not seq.is_finished:
                self.scheduler.rollback(seq, drafted - len(accepted))
                self.proposer.on_verified(seq, proposed, len(accepted) if drafted else 0)
            outputs.append(
                EngineCoreOutput(
                    rid,
                    seq.index,
                    tokens[:emitted],
                    logprobs[:emitted] if logprobs else None,
                    seq.finish_reason,
                    seq.stop_reason,
                    seq.num_cached_tokens,
                    seq.num_preemptions,
                    spec_num_draft_tokens=seq.num_spec_draft_tokens,
                    spec_num_accepted_tokens=seq.num_spec_accepted_tokens,
                )
            )
            if seq.is_finished and self.requests[rid].finished:
                del self.requests[rid]
        self._propose(sched)
        return outputs

    def _propose(self, sched: SchedulerOutput) -> None:
        """Guesses for the next step of every sequence this step sampled that may speculate: decoding freely
        (no grammar, no min_tokens block), with room for more than one token before max_tokens and the
        context's end."""
        seqs, counts = [], []
        limit = self.config.speculative_config.disable_by_batch_size
        busy = limit is not None and len(self.scheduler.running) >= limit  # verifying costs more than it saves
        for s in sched.scheduled:
            seq = s.seq
            seq.spec_token_ids = []
            if busy:
                continue
            if not s.samples or seq.is_finished or seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            p = seq.sampling_params
            room = self.max_model_len - len(seq.token_ids)
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            k = min(self.num_speculative_tokens, room)
            if k > 0 and seq.grammar is None and not seq.min_tokens_blocked:
                seqs.append(seq)
                counts.append(k)
        if seqs:
            for seq, k, guesses in zip(seqs, counts, self.proposer.propose(seqs, counts)):
                if self.fill_guesses and len(guesses) < k:  # every sequence k guesses: the verify step's graph runs
                    guesses = guesses + [guesses[-1] if guesses else seq.token_ids[-1]] * (k - len(guesses))
                seq.spec_token_ids = guesses

    def _append_token(self, seq: Sequence, token_id: int) -> None:
        """Token-level stops; stop strings are the front-end's (they need text)."""
        p = seq.sampling_params
        seq.append_token(token_id)
        self.num_generated_tokens += 1
        if seq.grammar is not None:
            self.structured_output.accept(seq.grammar, seq.output_token_ids)
        length = len(seq.token_ids)
        n_out = length - seq.num_prompt_tokens
        if n_out >= p.min_tokens or not seq.min_tokens_blocked:  # a grammar at its end lifts the block early
            if seq.min_tokens_blocked:
                seq.min_tokens_blocked = []
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return self._finish(seq, "stop", None)
            if p.stop_token_ids and token_id in p.stop_token_ids:
                return self._finish(seq, "stop", token_id)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or length >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        if self.proposer is not None:
            seq.spec_token_ids = []
            self.proposer.remove([seq.seq_id])

    # ---- failures --------------------------------------------------------------------------------
    def _fail_request(self, request_id: str, exc: Exception) -> EngineCoreOutput:
        """End one request with finish_reason "error" and free its blocks; the output carries the error."""
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req is not None else []:
            if not seq.is_finished:
                self._finish(seq, "error", None)
        return EngineCoreOutput(request_id, finish_reason="error", error=f"{type(exc).__name__}: {exc}")

    def _fail_request_in_step(self, sched: SchedulerOutput, exc: RequestError) -> list[EngineCoreOutput]:
        """The step did not complete because of one request: fail it; the other sequences go back to
        the queue to be recomputed (their KV for this step may be missing), and the prefix cache, which
        registered this step's blocks when it was planned, is dropped."""
        logger.error("step %d failed for request_id=%s: %s", self.step_id, exc.request_id, exc)
        if exc.request_id not in self.requests:  # not a request of this engine: nothing to single out
            self._fail_step(sched, exc)
            raise exc
        output = self._fail_request(exc.request_id, exc)
        for s in reversed(sched.scheduled):  # each goes to the queue's head: keep their order
            if not s.seq.is_finished:
                self.scheduler.requeue(s.seq)
        self.block_manager.reset_prefix_cache()
        return [output]

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> None:
        """A step that raised: its requests fail, and cached blocks it wrote can't be trusted."""
        logger.exception("step %d failed", self.step_id)
        for rid in dict.fromkeys(s.seq.request_id for s in sched.scheduled):
            if rid in self.requests:
                self._failed.append(self._fail_request(rid, exc))
        self.block_manager.reset_prefix_cache()

    def pop_failed_outputs(self) -> list[EngineCoreOutput]:
        """The error outputs of the requests the last raising step failed."""
        failed, self._failed = self._failed, []
        return failed


class InFlightStep:
    """A launched step: what was scheduled, the handle that reads it back, and whether the next step must
    wait for its tokens (a sampling parameter that reads the output so far: penalties, min_tokens, a grammar)."""

    def __init__(self, sched: SchedulerOutput, handle: StepFuture):
        self.sched, self.handle = sched, handle
        self.needs_sync = any(needs_output_history(s.seq) for s in sched.scheduled if s.samples)


def needs_output_history(seq: Sequence) -> bool:
    """Whether sampling this sequence's next token reads its latest token on the host (a grammar's bitmask too)."""
    p = seq.sampling_params
    return bool(
        seq.min_tokens_blocked
        or seq.grammar is not None
        or p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
    )


def resolve_max_model_len(config: EngineConfig, cache_tokens: int) -> int:
    """max_model_len as asked (checked against the model and the cache), or the most that fits."""
    mc = config.model_config
    model_max = mc.hf_config.max_position_embeddings
    if mc.max_model_len is not None and mc.max_model_len > model_max:
        raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's max_position_embeddings={model_max}")
    wanted = mc.max_model_len or model_max
    if wanted > cache_tokens:
        if mc.max_model_len is not None:
            raise ValueError(
                f"max_model_len={wanted} needs more KV cache than fits ({cache_tokens} tokens); "
                "lower max_model_len or give the cache more memory"
            )
        logger.warning("max_model_len lowered from %d to the KV cache's %d tokens", wanted, cache_tokens)
        wanted = cache_tokens
    return wanted

"""LLMEngine: the engine in one process, for the offline LLM, the CLI's generate/chat and in-process use.

It is the three pieces the server runs apart, called in turn: Processor (tokenize, check), an in-process
EngineCore (schedule, execute, token-level stops) and OutputProcessor (text, stop strings, outputs). A
stop-string hit aborts the sample in the core right away, as the server's front-end does over ZMQ.
"""

from __future__ import annotations

from novainfer.config import EngineConfig
from novainfer.engine.core import EngineCore, Request
from novainfer.engine.messages import AbortTarget, EngineCoreOutputs
from novainfer.engine.output_processor import OutputProcessor, RequestStatus
from novainfer.engine.processor import Processor, PromptType
from novainfer.loader.model_info import load_model_info
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestStatus", "load_model_info"]


class LLMEngine:
    """add_request / abort_request / step / has_unfinished_requests over an in-process EngineCore."""

    def __init__(self, config: EngineConfig):
        config, self.tokenizer, eos = load_model_info(config)
        self.config = config
        self.engine_core = EngineCore(config, eos)
        self.max_model_len = self.engine_core.max_model_len
        self.engine_core.structured_output.tokenizer = self.tokenizer  # in one process: load it once
        self.processor = Processor(
            self.tokenizer, self.max_model_len, self.engine_core.vocab_size, self.engine_core.structured_output
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def shutdown(self) -> None:
        """Stop the executor's workers (processes with the mp backend)."""
        self.engine_core.shutdown()

    # the core's parts, for callers and tests that look inside
    @property
    def executor(self):
        return self.engine_core.executor

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def block_manager(self):
        return self.engine_core.block_manager

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine_core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.engine_core.eos_token_ids = set(ids)

    @property
    def structured_output(self):
        return self.engine_core.structured_output

    @property
    def step_id(self) -> int:
        return self.engine_core.step_id

    @property
    def num_generated_tokens(self) -> int:
        return self.engine_core.num_generated_tokens

    @property
    def requests(self) -> dict[str, Request]:
        """The core's live requests (their sequences)."""
        return self.engine_core.requests

    # ---- requests --------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Queue a request; an unservable one raises ValueError before anything is queued."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, request = self.processor.process(request_id, prompt, params, arrival_time)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request_id, text, request.prompt_token_ids, params, request.arrival_time)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output (finish_reason abort)."""
        self.engine_core.abort_requests([AbortTarget(request_id)])
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, and apply one step; returns outputs of requests that advanced."""
        try:
            core_outputs = self.engine_core.step()
        except Exception:  # the core failed the step's requests: forget them here too, then raise
            self._process(EngineCoreOutputs(self.engine_core.pop_failed_outputs()))
            raise
        return self._process(core_outputs) if core_outputs is not None else []

    def _process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process_outputs(core_outputs.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs

    def make_stats(self):
        """The core's gauges and counters (metrics)."""
        return self.engine_core.make_stats()

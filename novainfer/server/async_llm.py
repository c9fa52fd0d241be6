"""AsyncLLM: the server's engine, split in two processes (vLLM V1's layout).

This process (the front-end) tokenizes and checks requests (Processor), sends them to an engine core process
(AsyncMPClient over ZMQ), and turns each step's token ids into text, stop-string ends and RequestOutputs
(OutputProcessor) on the event loop. The core runs the scheduler and the model without sharing this
interpreter's lock, so the API answers while the model runs. The core's death is seen at once (its process
sentinel is watched by the event loop): live requests fail with EngineDeadError and new ones get 503 (and the
server exits non-zero, for its supervisor to restart it). A core that makes no step progress for step_timeout
seconds while requests wait (frozen, e.g. SIGSTOP, or a hung device) is killed and treated the same way.
This process never imports torch: the core loads the model's config and tokenizer and sends the tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import msgspec

from novainfer.config import EngineConfig
from novainfer.engine.core_client import AsyncMPClient
from novainfer.engine.messages import AbortTarget, EngineCoreDead, EngineCoreOutputs, SchedulerStats
from novainfer.engine.output_processor import OutputProcessor
from novainfer.engine.processor import Processor
from novainfer.loader.model_info import with_model_path
from novainfer.structured_output import StructuredOutputManager
from novainfer.sampling_params import SamplingParams
from novainfer.server.async_engine import AsyncEngineBase, FinishedHook, StatsHook

logger = logging.getLogger(__name__)
DEATH_NOTICE_WAIT_S = 0.1  # after the process ends: time for its last message (why it died) to arrive


class AsyncLLM(AsyncEngineBase):
    """submit / stream / cancel over an engine core process."""

    def __init__(
        self,
        config: EngineConfig,
        on_stats: StatsHook | None = None,
        on_finished: FinishedHook | None = None,
        import_while_loading: tuple[str, ...] = (),
    ):
        """Starts the engine core and waits until it is ready; import_while_loading: AsyncMPClient's."""
        super().__init__(on_stats, on_finished)
        config = with_model_path(config)  # a bad path fails here, before the core process starts
        self.model_path = config.model_config.model
        self.config = config
        # the core loads the model's config and tokenizer (torch is there)
        self.core = AsyncMPClient(config, import_while_loading=import_while_loading)
        self.tokenizer = self.core.tokenizer
        ready = self.core.ready
        self.max_model_len, self.num_blocks = ready.max_model_len, ready.num_blocks
        self.processor = Processor(
            self.tokenizer,
            self.max_model_len,
            ready.vocab_size,
            StructuredOutputManager(self.tokenizer, ready.vocab_size, set(ready.eos_token_ids)),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._output_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._stopping = False
        self._last_message = time.monotonic()  # when the core last sent anything (each step sends)
        self._last_stats: SchedulerStats | None = None

    @property
    def core_pid(self) -> int:
        return self.core.proc.pid

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._output_task = self._loop.create_task(self._output_loop())
        self._loop.add_reader(self.core.sentinel, self._on_core_exit)
        if self.step_timeout:
            self._watchdog_task = self._loop.create_task(self._watchdog(self.step_timeout))

    def shutdown(self) -> None:
        """Stop the core process (after the server's drain) and the output task."""
        self._stopping = True
        if self._loop is not None:
            self._loop.remove_reader(self.core.sentinel)
        for task in (self._output_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        self.core.shutdown()

    async def _add(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        text, request = self.processor.process(request_id, prompt, params)
        self.output_processor.add_request(request_id, text, request.prompt_token_ids, params, request.arrival_time)
        self.core.add_request(request)

    def _abort(self, request_id: str) -> None:
        """Final output (finish_reason "abort") at once; the core frees the blocks when the abort arrives."""
        out = self.output_processor.abort_request(request_id)
        if not self.is_dead:
            self.core.abort_requests([AbortTarget(request_id)])
        if out is not None:
            self._deliver([out])

    # ---- outputs --------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                message = await self.core.get_output()
                self._last_message = time.monotonic()
                if isinstance(message, EngineCoreDead):
                    self._die(message.reason)
                    return
                self._process(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug on this side: the requests can't be followed any more
            logger.exception("engine output loop died")
            self._die(f"engine output loop died: {exc!r}")

    def _process(self, message: EngineCoreOutputs) -> None:
        if message.scheduler_stats is not None and self.on_stats is not None:
            self._last_stats = message.scheduler_stats
            self.on_stats(message.scheduler_stats)
        if not message.outputs:
            return
        outputs, to_abort = self.output_processor.process_outputs(message.outputs)
        if to_abort:  # stop strings ended these samples: free their blocks now
            self.core.abort_requests(to_abort)
        self._deliver(outputs)

    async def _watchdog(self, timeout: float) -> None:
        """Kill a core that sent nothing for `timeout` s while requests wait: a frozen core is a dead one."""
        while not self.is_dead:
            await asyncio.sleep(min(1.0, timeout / 4))
            live = [t.arrival_time for t in self._requests.values() if not t.is_terminal]
            if not live:
                continue
            stalled = time.monotonic() - max(self._last_message, min(live))
            if stalled > timeout:
                self._die(
                    f"engine loop died: the engine core process (pid {self.core.proc.pid}) made no step "
                    f"progress for {stalled:.1f} s with {len(live)} requests waiting (--engine-step-timeout "
                    f"{timeout:g}); it was killed"
                )
                self.core.proc.kill()  # SIGKILL ends a stopped process too

    def _die(self, reason: str) -> None:
        """Fail everything (the base class), then zero the core's gauges: nothing runs on a dead core."""
        super()._die(reason)
        if self._last_stats is not None and self.on_stats is not None:
            self.on_stats(
                msgspec.structs.replace(self._last_stats, num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0)
            )
            self._last_stats = None

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self.core.sentinel)
        if self._stopping:
            return
        self.core.proc.join(timeout=5.0)  # the sentinel can fire just before the child is reapable
        self._loop.call_later(
            DEATH_NOTICE_WAIT_S,
            self._die,
            "engine loop died: the engine core process (pid "
            f"{self.core.proc.pid}) {exit_status(self.core.proc.exitcode)}",
        )


def exit_status(code: int | None) -> str:
    """'exited with code 1', 'was killed by signal SIGKILL (-9)'; a child still unreaped says so."""
    if code is None:
        return "ended (its exit status could not be read)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name} ({code})"
    return f"exited with code {code}"

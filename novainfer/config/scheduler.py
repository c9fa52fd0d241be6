"""SchedulerConfig: the batching limits of one engine step."""

from __future__ import annotations

from dataclasses import dataclass

from novainfer.config.fields import setting

TOKEN_BUDGET_HELP = (
    "tokens one engine step may carry (auto: vLLM's offline default, 16384 on one CUDA GPU of "
    ">= 70 GiB other than an A100, else 8192)"
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits for one engine step."""

    max_num_seqs: int = setting(256, "sequences one engine step may carry")
    max_num_batched_tokens: int | None = setting(None, TOKEN_BUDGET_HELP)  # None: EngineConfig.resolve_token_budget
    enable_chunked_prefill: bool = setting(True, "split long prompts over several steps")
    async_scheduling: bool | None = setting(
        None, "plan step N+1 while step N runs (auto: on with CUDA, off on the CPU)"
    )

    def validate(self) -> None:
        """Reject values that can never work, naming the field."""
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

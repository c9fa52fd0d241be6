"""Prometheus metrics under two names each: NovaInfer's (`novainfer:`) and vLLM's (`vllm:`), which routers read.

The Gateway API Inference Extension's endpoint picker, llm-d, sglang-router and vllm-router pick replicas from
vLLM's gauges (`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:cache_config_info`), so every metric is declared once below and registered under both prefixes.
Also the one log line per finished request.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from novainfer.config import EngineConfig
from novainfer.engine.messages import SchedulerStats
from novainfer.server.async_engine import TrackedRequest

logger = logging.getLogger("novainfer.server.requests")

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
PREFIXES = ("novainfer", "vllm")


class _Children:
    """The labelled children of one metric's every name: set/inc/observe reach them all."""

    def __init__(self, children: list[Any]):
        self.children = children

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class _Metric:
    """One metric registered as `<prefix>:<name>` for each prefix, plus vLLM's other names for it (aliases)."""

    def __init__(
        self,
        kind: type,
        registry: CollectorRegistry,
        name: str,
        doc: str,
        labels: list[str],
        aliases: tuple[str, ...] = (),
        **kw: Any,
    ):
        names = [f"{p}:{name}" for p in PREFIXES] + [f"vllm:{a}" for a in aliases]
        self.metrics = [kind(n, doc, labels, registry=registry, **kw) for n in names]

    def labels(self, *values: str) -> _Children:
        return _Children([m.labels(*values) for m in self.metrics])


class ServerMetrics:
    """One registry per server; engine gauges come from the core's stats, sent with each step's outputs.

    `frontend_waiting` gives the requests queued in the HTTP admission limiter (server/limits.py): they count
    as waiting too, as a router must see them. The limiter is shared, so with several models each counts them.
    """

    def __init__(self, frontend_waiting: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry()
        self.frontend_waiting = frontend_waiting
        r, m = self.registry, ["model_name"]

        def metric(kind: type, name: str, doc: str, labels: list[str] = m, **kw: Any) -> _Metric:
            return _Metric(kind, r, name, doc, labels, **kw)

        self.running = metric(Gauge, "num_requests_running", "Requests in the running batch")
        self.waiting = metric(
            Gauge,
            "num_requests_waiting",
            "Requests waiting to be scheduled, in the engine or for an admission slot of the HTTP front-end",
        )
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)")
        self.cache_info = metric(
            Gauge,
            "cache_config_info",
            "The KV cache's configuration (value 1)",
            m
            + [
                "block_size",
                "num_gpu_blocks",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "num_cpu_blocks",
            ],
        )
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = metric(Counter, "num_preemptions", "Sequences preempted (recomputed later)")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens")
        self.request_success = metric(
            Counter, "request_success", "Requests ended, by finish reason", m + ["finished_reason"]
        )
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS)
        self.tpot = metric(
            Histogram,
            "time_per_output_token_seconds",
            "Mean time per output token after the first",
            aliases=("request_time_per_output_token_seconds",),
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = metric(Histogram, "e2e_request_latency_seconds", "Arrival to last output", buckets=_LATENCY_BUCKETS)
        self.spec_drafts = metric(
            Counter, "spec_decode_num_drafts", "Sequence-steps that verified guessed tokens (speculative decoding)"
        )
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Guessed tokens verified")
        self.spec_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Guessed tokens accepted")
        self.spec_emitted_tokens = metric(
            Counter,
            "spec_decode_num_emitted_tokens",
            "Tokens emitted by verify steps (accepted guesses plus one sampled token each)",
        )
        self.spec_mean_accepted_length = metric(
            Gauge, "spec_decode_mean_accepted_length", "Emitted tokens per verified sequence-step, since start"
        )
        self._seen: dict[str, tuple[int, ...]] = {}  # last cumulative engine counts per model
        self._engine_waiting: dict[str, int] = {}

    def set_cache_info(self, model: str, config: EngineConfig, num_blocks: int) -> None:
        """vLLM's info-style gauge: the cache configuration as labels, value 1 (the endpoint picker reads
        block_size and num_gpu_blocks from it)."""
        c = config.cache_config
        self.cache_info.labels(
            model,
            str(c.block_size),
            str(num_blocks),
            c.cache_dtype,
            str(c.enable_prefix_caching),
            str(c.gpu_memory_utilization),
            "0",
        ).set(1)

    def observe_stats(self, model: str, stats: SchedulerStats) -> None:
        """Refresh gauges and add the core's cumulative counters' growth since the last call."""
        self.running.labels(model).set(stats.num_running_reqs)
        self._engine_waiting[model] = stats.num_waiting_reqs
        self.waiting.labels(model).set(stats.num_waiting_reqs + self.frontend_waiting())
        self.kv_usage.labels(model).set(stats.kv_cache_usage)
        now = (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            stats.num_preemptions,
            stats.num_generation_tokens,
            stats.spec_num_drafts,
            stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens,
            stats.spec_num_emitted_tokens,
        )
        last = self._seen.get(model, (0,) * len(now))
        for counter, new, old in zip(
            (
                self.prefix_queries,
                self.prefix_hits,
                self.preemptions,
                self.generation_tokens,
                self.spec_drafts,
                self.spec_draft_tokens,
                self.spec_accepted_tokens,
                self.spec_emitted_tokens,
            ),
            now,
            last,
        ):
            if new > old:
                counter.labels(model).inc(new - old)
        if stats.spec_num_drafts:
            self.spec_mean_accepted_length.labels(model).set(stats.spec_num_emitted_tokens / stats.spec_num_drafts)
        self._seen[model] = now

    def record_finished(self, model: str, tracked: TrackedRequest, reason: str | None, end: float) -> None:
        """Count a request that reached a terminal state, and log one structured line for it."""
        out = tracked.last_output
        prompt_tokens = len(out.prompt_token_ids) if out else 0
        completion_tokens = sum(len(c.token_ids) for c in out.outputs) if out else 0
        latency = end - tracked.arrival_time
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.request_success.labels(model, reason or "unknown").inc()
        self.e2e.labels(model).observe(latency)
        if tracked.first_output_time is not None:
            self.ttft.labels(model).observe(tracked.first_output_time - tracked.arrival_time)
            per_seq = completion_tokens / max(1, len(out.outputs)) if out else 0
            if per_seq > 1:
                self.tpot.labels(model).observe((end - tracked.first_output_time) / (per_seq - 1))
        logger.info(
            json.dumps(
                {
                    "event": "request_finished",
                    "request_id": tracked.request_id,
                    "model": model,
                    "status": tracked.status.value,
                    "finish_reason": reason,
                    "latency_s": round(latency, 4),
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "cached_tokens": out.num_cached_tokens if out else 0,
                }
            )
        )

    def render(self) -> bytes:
        """The exposition text; the waiting gauges first take in the admission queue as it is now."""
        queued = self.frontend_waiting()
        for model, waiting in self._engine_waiting.items():
            self.waiting.labels(model).set(waiting + queued)
        return generate_latest(self.registry)

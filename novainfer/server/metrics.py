"""Prometheus metrics named after vLLM's (prefix `novainfer:`), and the one log line per finished request."""
from __future__ import annotations

import json
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from novainfer.engine.messages import SchedulerStats
from novainfer.server.async_engine import TrackedRequest

logger = logging.getLogger("novainfer.server.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """One registry per server; engine gauges come from the core's stats, sent with each step's outputs."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.running = Gauge("novainfer:num_requests_running", "Requests in the running batch", m, registry=r)
        self.waiting = Gauge("novainfer:num_requests_waiting", "Requests waiting to be scheduled", m, registry=r)
        self.kv_usage = Gauge("novainfer:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", m,
                              registry=r)
        self.prefix_queries = Counter("novainfer:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", m, registry=r)
        self.prefix_hits = Counter("novainfer:prefix_cache_hits", "Prompt tokens found in the prefix cache", m,
                                   registry=r)
        self.preemptions = Counter("novainfer:num_preemptions", "Sequences preempted (recomputed later)", m,
                                   registry=r)
        self.prompt_tokens = Counter("novainfer:prompt_tokens", "Prompt tokens of finished requests", m,
                                     registry=r)
        self.generation_tokens = Counter("novainfer:generation_tokens", "Generated tokens", m, registry=r)
        self.request_success = Counter("novainfer:request_success", "Requests ended, by finish reason",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram("novainfer:time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("novainfer:time_per_output_token_seconds", "Mean time per output token after "
                              "the first", m, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("novainfer:e2e_request_latency_seconds", "Arrival to last output", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter("novainfer:spec_decode_num_drafts", "Sequence-steps that verified guessed "
                                   "tokens (speculative decoding)", m, registry=r)
        self.spec_draft_tokens = Counter("novainfer:spec_decode_num_draft_tokens", "Guessed tokens verified", m,
                                         registry=r)
        self.spec_accepted_tokens = Counter("novainfer:spec_decode_num_accepted_tokens", "Guessed tokens accepted",
                                            m, registry=r)
        self.spec_emitted_tokens = Counter("novainfer:spec_decode_num_emitted_tokens", "Tokens emitted by "
                                           "verify steps (accepted guesses plus one sampled token each)", m,
                                           registry=r)
        self.spec_mean_accepted_length = Gauge("novainfer:spec_decode_mean_accepted_length", "Emitted tokens per "
                                               "verified sequence-step, since start", m, registry=r)
        self._seen: dict[str, tuple[int, ...]] = {}  # last cumulative engine counts per model

    def observe_stats(self, model: str, stats: SchedulerStats) -> None:
        """Refresh gauges and add the core's cumulative counters' growth since the last call."""
        self.running.labels(model).set(stats.num_running_reqs)
        self.waiting.labels(model).set(stats.num_waiting_reqs)
        self.kv_usage.labels(model).set(stats.kv_cache_usage)
        now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions,
               stats.num_generation_tokens, stats.spec_num_drafts, stats.spec_num_draft_tokens,
               stats.spec_num_accepted_tokens, stats.spec_num_emitted_tokens)
        last = self._seen.get(model, (0,) * len(now))
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions,
                                      self.generation_tokens, self.spec_drafts, self.spec_draft_tokens,
                                      self.spec_accepted_tokens, self.spec_emitted_tokens), now, last):
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
        logger.info(json.dumps({
            "event": "request_finished", "request_id": tracked.request_id, "model": model,
            "status": tracked.status.value, "finish_reason": reason, "latency_s": round(latency, 4),
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": out.num_cached_tokens if out else 0}))

    def render(self) -> bytes:
        return generate_latest(self.registry)

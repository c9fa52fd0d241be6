"""KVEventsConfig: vLLM's `--kv-events-config` (engine/kv_events.py publishes what it asks for)."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`, vLLM's keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # zmq or null; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""

    @classmethod
    def from_value(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        """The config from a JSON object (text or dict); None when events are off. Unknown keys are refused."""
        if value is None or isinstance(value, KVEventsConfig):
            cfg = value
        else:
            raw = json.loads(value) if isinstance(value, str) else dict(value)
            unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"kv_events_config: unsupported field(s) {sorted(unknown)}")
            cfg = cls(**raw)
        if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher == "null":
            return None
        if cfg.publisher not in (None, "zmq"):
            raise ValueError(f"kv_events_config.publisher must be zmq or null, got {cfg.publisher!r}")
        if cfg.buffer_steps < 1 or cfg.max_queue_size < 1 or cfg.hwm < 0:
            raise ValueError("kv_events_config: buffer_steps and max_queue_size must be >= 1, hwm >= 0")
        return cfg

"""ServerConfig: the HTTP server's knobs (`novainfer serve` flags); the engines have their own EngineConfig."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's knobs (`novainfer serve` flags); the engines have their own EngineConfig."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never printed; see resolve_api_key
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser), as vLLM's flag
    tool_call_parser: str | None = None  # server/tool_parsers: hermes (Qwen2.5/Qwen3), llama3_json
    max_concurrent_requests: int = 256  # generation requests in flight at once
    max_queue_len: int = 512  # requests waiting for a slot; past it: 429
    max_sessions: int = 1024  # session_id histories kept (least recently used dropped)
    session_ttl: float = 3600.0  # seconds an idle session is kept
    retry_after: int = 1  # seconds, sent with 429
    max_request_body_bytes: int = 4 << 20  # larger bodies get 413 before they are parsed
    allowed_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are given
    shutdown_timeout: float = 10.0  # on SIGTERM, seconds in-flight requests may finish before they are aborted

    @staticmethod
    def resolve_api_key(flag: str | None, key_file: str | None) -> str | None:
        """The API key from --api-key, else --api-key-file (its first line), else the NOVAINFER_API_KEY
        environment variable (documented in the README): the last two keep it out of `ps`."""
        if flag:
            return flag
        if key_file:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
            if not key:
                raise ValueError(f"--api-key-file {key_file} is empty")
            return key
        return os.environ.get("NOVAINFER_API_KEY") or None

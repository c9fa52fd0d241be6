"""ServerConfig: the HTTP server's knobs (`novainfer serve` flags); the engines have their own EngineConfig."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from novainfer.config.fields import setting


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's knobs (`novainfer serve` flags); the engines have their own EngineConfig."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    # never printed (repr=False); resolve_api_key reads --api-key-file and NOVAINFER_API_KEY too
    api_key: str | None = dataclasses.field(
        default=None,
        repr=False,
        metadata={
            "help": "require 'Authorization: Bearer <key>' on the API (visible in `ps`: prefer --api-key-file or "
            "the NOVAINFER_API_KEY environment variable)",
            "shown": "none",
        },
    )
    enable_auto_tool_choice: bool = setting(
        True,
        'allow tool_choice "auto" (the model decides whether to call); '
        "on by default, the flag kept for vLLM's command lines",
    )
    tool_call_parser: str | None = setting(
        None,
        "the model's tool-call format: hermes, qwen3_coder, llama3_json, pythonic, mistral, gemma4, openai",
        shown="from the chat template",
    )
    reasoning_parser: str | None = setting(
        None, "split reasoning into reasoning_content: qwen3, deepseek_r1", shown="from the chat template"
    )
    max_concurrent_requests: int = setting(256, "generation requests in flight at once")
    max_queue_len: int = setting(512, "requests allowed to wait for a slot; past it the server answers 429")
    max_sessions: int = setting(1024, "session_id histories kept (the least recently used dropped)")
    session_ttl: float = setting(3600.0, "seconds an idle session is kept")
    retry_after: int = setting(1, "seconds a 429 answer tells the client to wait")
    max_request_body_bytes: int = setting(4 << 20, "larger request bodies are refused with 413")
    allowed_origins: list[str] = setting(
        help="origins allowed by CORS (e.g. http://localhost:3000 or *)",
        default_factory=list,
        nargs="+",
        shown="none: CORS is off",
    )
    trust_request_chat_template: bool = setting(
        False,
        "accept a client-supplied chat template (chat_template_kwargs.chat_template); off: such a request gets 400",
    )
    stream_write_timeout: float = setting(
        30.0,
        "seconds a response write may wait for a client that stopped "
        "reading; then the connection is dropped and its request aborted",
    )
    engine_step_timeout: float = setting(
        60.0,
        "seconds an engine core may make no step progress while requests "
        "wait; past it the core is treated as dead (killed, /health 503, the "
        "server exits non-zero)",
    )
    request_header_timeout: float = setting(
        10.0,
        "seconds a connection may take to send a whole request head "
        "(after connecting, or from the first byte of its next request); "
        "then it is closed",
    )
    keep_alive_timeout: float = setting(
        65.0,
        "seconds an idle keep-alive connection waits for its next request; "
        "longer than clients' pools keep one (httpx 5 s) and load balancers' "
        "idle timeouts (60 s), so none reuses a connection the server is closing",
    )
    shutdown_timeout: float = setting(10.0, "on SIGTERM, seconds in-flight requests may finish before they are aborted")
    drain_delay: float = setting(
        0.0,
        "on SIGTERM, seconds /ready answers 503 (routers stop sending) while "
        "requests are still taken, before the drain starts",
    )

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

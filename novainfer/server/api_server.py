"""The FastAPI app: OpenAI routes, request ids, API key, errors in OpenAI's shape, metrics; and `serve`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

import novainfer
from novainfer.config import ServerConfig
from novainfer.server import anthropic
from novainfer.server.anthropic import MessagesHandler
from novainfer.server.async_engine import AsyncEngineBase, TrackedRequest
from novainfer.server.chat_templates import encode, render_chat
from novainfer.server.errors import APIError, error_body, error_response
from novainfer.server.limits import AdmissionLimiter
from novainfer.server.metrics import ServerMetrics
from novainfer.server.router_compat import drop_router_defaults
from novainfer.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from novainfer.server.protocol_anthropic import AnthropicErrorResponse, CountTokensRequest, MessagesRequest
from novainfer.server.protocol_responses import ResponsesRequest
from novainfer.server.request_context import REQUEST_ID
from novainfer.server.responses import ResponsesHandler
from novainfer.server.serving import OpenAIServing, ServedModel
from novainfer.server.serving_completions import CompletionHandler
from novainfer.server.sessions import SessionStore
from novainfer.server.sse import ClientStalledError, bounded_send
from novainfer.server.tool_calling import ToolConfig

logger = logging.getLogger(__name__)
_VALID_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII without spaces
# pydantic names the member of a union that failed ("constrained-str", "list[int]"): not part of the field path
_UNION_MEMBER = re.compile(r"^(constrained-)?(str|int|float|bool|none|list\[.*\]|dict\[.*\])$|^function-")
_PUBLIC_PATHS = ("/health", "/ready", "/v2/health/ready", "/metrics", "/version", "/openapi.json", "/webui/")
# 413: a body over --max-request-body-bytes; 500: a request whose engine step fails (naming its request_id)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 500, 503)
}
_STREAMING = {
    200: {
        "description": "The completion; with `stream: true`, SSE chunks (`data: {json}`) then `data: [DONE]`",
        # in OpenAPI 3.1 an event stream's schema describes each event
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] last"}},
                }
            }
        },
    },
    **_ERRORS,
}
_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": AnthropicErrorResponse} for code in _ERRORS}


def _events(description: str, errors: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """The documented answers of a route whose `stream: true` answers with named SSE events."""
    return {
        200: {
            "description": description,
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": {"type": "string"},
                            "data": {"type": "string", "description": "the event as JSON"},
                        },
                    }
                }
            },
        },
        **errors,
    }


WEBUI_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "webui")


class RequestContextMiddleware:
    """Pure ASGI (so streaming and disconnects pass untouched): X-Request-Id on every response, the API key,
    and the body size limit (a body is read whole, up to the limit, before the app sees it)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, write_timeout: float):
        self.app, self.max_body_bytes, self.write_timeout = app, max_body_bytes, write_timeout
        # compared as digests: equal length whatever was sent, so the comparison's time says nothing
        self.key_digest = hashlib.sha256(f"Bearer {api_key}".encode()).digest() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        sent = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if _VALID_ID.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = REQUEST_ID.set(request_id)
        path = scope.get("path", "")

        bounded = bounded_send(send, self.write_timeout)  # a client that stops reading is dropped

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await bounded(message)

        async def refuse(status: int, message: str, code: str) -> None:
            logger.info("%d %s: %s", status, path, message)
            body = (
                anthropic.error_body(status, message, request_id)
                if path.startswith(anthropic.PATH_PREFIX)
                else error_body(status, message, request_id, code=code)
            )
            await JSONResponse(body, status_code=status)(scope, receive, send_with_id)

        try:
            repeated = [
                n.decode("latin-1")
                for n in (b"authorization", b"x-api-key")
                if sum(1 for k, _ in scope.get("headers") or [] if k == n) > 1
            ]
            if repeated:  # which one a proxy or this server would read differs: refuse rather than guess
                return await refuse(
                    400, f"the {repeated[0].title()} header is repeated; send it once", "invalid_request_error"
                )
            if self.key_digest and path != "/" and not path.startswith(_PUBLIC_PATHS):
                given = hashlib.sha256(headers.get(b"authorization", b"")).digest()
                given_x = hashlib.sha256(b"Bearer " + headers.get(b"x-api-key", b"")).digest()  # Anthropic's header
                if not (
                    secrets.compare_digest(given, self.key_digest) | secrets.compare_digest(given_x, self.key_digest)
                ):
                    return await refuse(
                        401,
                        "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                        "invalid_api_key",
                    )
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await self._read_body(headers, receive)
                if body is None:
                    return await refuse(
                        413,
                        f"Request body too large: the limit is {self.max_body_bytes} bytes (--max-request-body-bytes)",
                        "request_too_large",
                    )
                receive = _replay(drop_router_defaults(path, body), receive)
            await self.app(scope, receive, send_with_id)
        except ClientStalledError as exc:  # returning with the response unfinished makes uvicorn close it
            logger.warning("%s %s: connection dropped: %s", scope.get("method"), path, exc)
        finally:
            REQUEST_ID.reset(token)

    async def _read_body(self, headers: dict, receive: Any) -> bytes | None:
        """The whole body, or None as soon as it is known to exceed the limit (declared or counted)."""
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left; the app will see the disconnect
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI receive that gives `body` once, then whatever the connection says (e.g. disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict:
        return pending.pop() if pending else await receive()

    return replayed


def _request_id(request: Request) -> str:
    return request.state.request_id


def build_app(engines: list[tuple[str, AsyncEngineBase]], config: ServerConfig) -> FastAPI:
    """The app serving each (name, engine): an AsyncLLM (its engine core in a process of its own). The engines
    start and stop with the app."""
    limiter = AdmissionLimiter(config.max_concurrent_requests, config.max_queue_len, config.retry_after)
    metrics = ServerMetrics(frontend_waiting=lambda: limiter.num_waiting)

    def record_finished(model: str, tracked: TrackedRequest, reason: str | None) -> None:
        token = REQUEST_ID.set(tracked.request_id)  # so its log line carries the id like the others
        try:
            metrics.record_finished(model, tracked, reason, time.monotonic())
        finally:
            REQUEST_ID.reset(token)

    served = []
    for name, engine in engines:
        engine.on_stats = lambda stats, n=name: metrics.observe_stats(n, stats)
        engine.on_finished = lambda t, r, n=name: record_finished(n, t, r)
        metrics.set_cache_info(name, engine.config, engine.num_blocks)
        engine.on_dead = lambda reason: setattr(app.state, "fatal", reason)  # the launcher exits non-zero
        engine.step_timeout = config.engine_step_timeout
        served.append(ServedModel.create(name, engine))
    serving = OpenAIServing(served, limiter, SessionStore(config.max_sessions, config.session_ttl))
    handler = CompletionHandler(
        serving,
        ToolConfig(config.enable_auto_tool_choice, config.tool_call_parser),
        config.reasoning_parser,
        config.trust_request_chat_template,
    )
    responses = ResponsesHandler(handler, SessionStore(config.max_sessions, config.session_ttl))
    messages = MessagesHandler(handler)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for m in served:
            m.engine.start()
        app.state.ready = True  # the engines loaded before the app was built; from here they take requests
        yield
        app.state.ready = False
        for m in served:
            m.engine.shutdown()

    # no /docs or /redoc: their pages load Swagger UI and ReDoc from a CDN, blank offline; /openapi.json stays
    app = FastAPI(
        title="NovaInfer OpenAI-compatible API",
        version=novainfer.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        RequestContextMiddleware,
        api_key=config.api_key,
        max_body_bytes=config.max_request_body_bytes,
        write_timeout=config.stream_write_timeout,
    )
    if config.allowed_origins:  # off by default; outermost, so preflights and 401/413 answers carry its headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.state.serving, app.state.metrics, app.state.ready = serving, metrics, False

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        logger.info("error %d: %s", exc.status, exc.message)
        shaped = anthropic.error_response if request.url.path.startswith(anthropic.PATH_PREFIX) else error_response
        return shaped(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # of a union's members, the one of the right type says what is wrong (a too-long list, not "not a string")
        first = next((e for e in errors if not str(e.get("type")).endswith("_type")), errors[0]) if errors else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return await on_api_error(request, APIError(400, f"Invalid JSON body: {reason}"))
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_MEMBER.match(str(p)))
        message = f"{loc or 'body'}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "extra_forbidden":  # no silent ignores: README, "Request fields"
            message = f'{loc}: this server does not support the field `{loc}` (README, "Request fields")'
        return await on_api_error(request, APIError(400, message, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # the exception's headers matter: a 405 must say which methods are allowed (Allow, RFC 9110)
        return await on_api_error(request, APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error")
        # Starlette runs this handler outside every middleware, so X-Request-Id is set here
        request_id = _request_id(request)
        shaped = anthropic.error_response if request.url.path.startswith(anthropic.PATH_PREFIX) else error_response
        return shaped(APIError(500, f"internal error: {exc!r}", headers={"X-Request-Id": request_id}), request_id)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMING)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions; `stream: true` answers with SSE chunks."""
        return await handler.chat(body, _request_id(request), request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_STREAMING)
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI text completions over a string, a list of strings, or token ids."""
        return await handler.completion(body, _request_id(request), request)

    @app.post(
        "/v1/responses",
        responses=_events(
            "The Response; with `stream: true`, SSE events `response.created` ... `response.completed`", _ERRORS
        ),
    )
    async def create_response(body: ResponsesRequest, request: Request):
        """OpenAI Responses API over the chat path; `stream: true` answers with SSE events."""
        return await responses.create(body, _request_id(request), request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str) -> dict:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
    async def cancel_response(response_id: str) -> dict:
        return await responses.cancel(response_id)

    @app.post(
        "/v1/messages",
        responses=_events(
            "The Message; with `stream: true`, SSE events `message_start` ... `message_stop`", _ANTHROPIC_ERRORS
        ),
    )
    async def create_message(body: MessagesRequest, request: Request):
        """Anthropic Messages API over the chat path; `stream: true` answers with Anthropic's SSE events."""
        return await messages.create(body, _request_id(request), request)

    @app.post("/v1/messages/count_tokens", responses=_ANTHROPIC_ERRORS)
    async def count_message_tokens(body: CountTokensRequest) -> dict:
        return await messages.count_tokens(body)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=m.name, root=m.path, max_model_len=m.max_model_len) for m in served])

    @app.post("/v1/requests/{request_id}/cancel", responses=_ERRORS)
    async def cancel(request_id: str) -> dict:
        """Abort a running request by its id (X-Request-Id, or the response's chatcmpl-/cmpl- id)."""
        bare = re.sub(r"^(chatcmpl-|cmpl-)", "", request_id)
        for m in served:
            if await m.engine.cancel(request_id) or (bare != request_id and await m.engine.cancel(bare)):
                return {"id": request_id, "object": "request.cancel", "cancelled": True}
        raise APIError(404, f"no running request with id {request_id!r}", param="request_id")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        m = serving.resolve_model(body.model)
        if body.messages is not None:
            msgs = [{"role": x.role, "content": x.text()} for x in body.messages]
            ids = await render_chat(m.tokenizer, msgs, body.add_generation_prompt)
        elif body.prompt is not None:
            ids = await encode(m.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return TokenizeResponse(count=len(ids), max_model_len=m.max_model_len, tokens=list(ids))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        m = serving.resolve_model(body.model)
        if any(not 0 <= t < len(m.tokenizer) for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {len(m.tokenizer)})", param="tokens")
        return DetokenizeResponse(prompt=m.tokenizer.decode(body.tokens))

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "Every engine is alive (empty body)"}, 503: _ERRORS[503]},
    )
    async def health() -> Response:
        if serving.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        dead = [m.name for m in served if m.engine.is_dead]
        if dead:
            raise APIError(503, f"engine dead for {', '.join(dead)}")
        return Response(status_code=200)

    @app.get(
        "/ready",
        response_class=Response,
        responses={200: {"description": "Accepting requests (empty body)"}, 503: _ERRORS[503]},
    )
    @app.get("/v2/health/ready", response_class=Response, include_in_schema=False)  # KServe's name for it
    async def ready() -> Response:
        """Readiness (Kubernetes readinessProbe, routers): 503 from SIGTERM on, before the drain begins."""
        if not app.state.ready or serving.draining:
            raise APIError(503, "the server is not accepting requests (starting or shutting down)", code="not_ready")
        await health()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": novainfer.__version__}

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        page = os.path.join(WEBUI_DIR, "index.html")
        if os.path.exists(page):
            with open(page, encoding="utf-8") as f:
                return HTMLResponse(f.read())
        names = ", ".join(m.name for m in served)
        return HTMLResponse(
            f"<h1>NovaInfer</h1><p>Serving {names}. OpenAI API under <code>/v1</code>; "
            f"see <a href='/openapi.json'>/openapi.json</a> and <a href='/metrics'>/metrics</a>.</p>"
        )

    # The page's scripts and styles; they load without the API key (the page sends the key the user typed).
    app.mount("/webui", StaticFiles(directory=WEBUI_DIR, check_dir=False), name="webui")
    app.openapi = lambda: _openapi_without_422(app)
    return app


def _openapi_without_422(app: FastAPI) -> dict:
    """FastAPI documents validation failures as 422; this server answers them with 400 (as vLLM does)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for op in operations.values():
                if op.get("responses", {}).pop("422", None) is not None:
                    op["responses"].setdefault(
                        "400",
                        {
                            "description": "Invalid request",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                        },
                    )
        app.openapi_schema = schema
    return app.openapi_schema

"""The FastAPI app: OpenAI routes, request ids, API key, errors in OpenAI's shape, metrics; and `serve`."""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import secrets
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

import novainfer
from novainfer.config import ServerConfig
from novainfer.engine.llm_engine import LLMEngine
from novainfer.entrypoints.chat_utils import apply_chat_template
from novainfer.server.async_engine import AsyncLLMEngine, TrackedRequest
from novainfer.server.errors import APIError, error_body, error_response
from novainfer.server.limits import AdmissionLimiter
from novainfer.server.metrics import ServerMetrics
from novainfer.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                       ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from novainfer.server.serving import OpenAIServing, ServedModel
from novainfer.server.serving_completions import CompletionHandler
from novainfer.server.sessions import SessionStore

logger = logging.getLogger(__name__)
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII without spaces
_PUBLIC_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc", "/webui/")
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}
_STREAMING = {200: {"content": {"text/event-stream": {"description": "with stream=true: SSE chunks, then [DONE]"}}},
              **_ERRORS}
WEBUI_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "webui")


class RequestIdFilter(logging.Filter):
    """Adds the current request id to every log record (`-` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class RequestContextMiddleware:
    """Pure ASGI (so streaming and disconnects pass untouched): X-Request-Id on every response, API key."""

    def __init__(self, app: Any, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        sent = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if _VALID_ID.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = REQUEST_ID.set(request_id)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)
        try:
            path = scope.get("path", "")
            if self.api_key and path != "/" and not path.startswith(_PUBLIC_PATHS):
                given = headers.get(b"authorization", b"").decode("latin-1")
                if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    logger.info("401 %s", path)
                    body = error_body(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      request_id, code="invalid_api_key")
                    return await JSONResponse(body, status_code=401)(scope, receive, send_with_id)
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


def _request_id(request: Request) -> str:
    return request.state.request_id


def build_app(engines: list[tuple[str, LLMEngine]], config: ServerConfig) -> FastAPI:
    """The app serving each (name, engine); the engine loops start and stop with the app."""
    metrics = ServerMetrics()

    def record_finished(model: str, tracked: TrackedRequest, reason: str | None) -> None:
        token = REQUEST_ID.set(tracked.request_id)  # so its log line carries the id like the others
        try:
            metrics.record_finished(model, tracked, reason, time.monotonic())
        finally:
            REQUEST_ID.reset(token)
    served = []
    for name, llm in engines:
        engine = AsyncLLMEngine(llm, on_step=lambda e, n=name: metrics.observe_engine(n, e),
                                on_finished=lambda t, r, n=name: record_finished(n, t, r))
        served.append(ServedModel.create(name, engine))
    serving = OpenAIServing(served, AdmissionLimiter(config.max_concurrent_requests, config.max_queue_len,
                                                     config.retry_after),
                            SessionStore(config.max_sessions, config.session_ttl))
    handler = CompletionHandler(serving)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for m in served:
            m.engine.start()
        yield
        for m in served:
            m.engine.shutdown()

    app = FastAPI(title="NovaInfer OpenAI-compatible API", version=novainfer.__version__, lifespan=lifespan)
    app.add_middleware(RequestContextMiddleware, api_key=config.api_key)
    app.state.serving, app.state.metrics = serving, metrics

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        logger.info("error %d: %s", exc.status, exc.message)
        return error_response(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return await on_api_error(request, APIError(400, f"Invalid JSON body: {reason}"))
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc or 'body'}: {first.get('msg', 'invalid request')}"
        return await on_api_error(request, APIError(400, message, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return await on_api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {exc!r}"), _request_id(request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMING)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions; `stream: true` answers with SSE chunks."""
        return await handler.chat(body, _request_id(request), request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_STREAMING)
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI text completions over a string, a list of strings, or token ids."""
        return await handler.completion(body, _request_id(request), request)

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
            ids = apply_chat_template(m.tokenizer, msgs, body.add_generation_prompt)
        elif body.prompt is not None:
            ids = m.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return TokenizeResponse(count=len(ids), max_model_len=m.max_model_len, tokens=list(ids))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        m = serving.resolve_model(body.model)
        if any(not 0 <= t < len(m.tokenizer) for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {len(m.tokenizer)})", param="tokens")
        return DetokenizeResponse(prompt=m.tokenizer.decode(body.tokens))

    @app.get("/health")
    async def health() -> Response:
        dead = [m.name for m in served if m.engine.is_dead]
        if dead:
            raise APIError(503, f"engine dead for {', '.join(dead)}")
        return Response(status_code=200)

    @app.get("/metrics")
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
        return HTMLResponse(f"<h1>NovaInfer</h1><p>Serving {names}. OpenAI API under <code>/v1</code>; "
                            f"see <a href='/docs'>/docs</a> and <a href='/metrics'>/metrics</a>.</p>")

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
                    op["responses"].setdefault("400", {"description": "Invalid request", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        app.openapi_schema = schema
    return app.openapi_schema

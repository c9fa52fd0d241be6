"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, naming the request id."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from novainfer.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; the app turns it into an OpenAI-shaped JSON error with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(
    status: int, message: str, request_id: str | None, param: str | None = None, code: str | int | None = None
) -> dict:
    default = "invalid_request_error" if status < 500 else "internal_error"  # e.g. 405, 413
    info = ErrorInfo(
        message=message,
        type=_TYPES.get(status, default),
        param=param,
        code=code if code is not None else status,
        request_id=request_id,
    )
    return ErrorResponse(error=info).model_dump()


def error_response(exc: APIError, request_id: str | None) -> JSONResponse:
    return JSONResponse(
        error_body(exc.status, exc.message, request_id, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )

"""The current request's id, for log records: set per request by the API server, read by every log line."""

from __future__ import annotations

import contextvars
import logging

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds the current request id to every log record (`-` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True

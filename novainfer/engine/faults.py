"""Failures that belong to one request.

A step can fail because of one request (its inputs, its detokenization, its stop checks). Such a failure
raises RequestError naming the request, so the engine fails that request alone and the rest of the batch
goes on.
"""

from __future__ import annotations


class RequestError(RuntimeError):
    """A step failed because of this request only."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id

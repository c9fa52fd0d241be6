"""Failures that belong to one request, and the test-only hook that injects them.

A step can fail because of one request (its inputs, its detokenization, its stop checks). Such a failure
raises RequestError naming the request, so the engine fails that request alone and the rest of the batch
goes on. FaultInjector raises one on purpose; it is off unless EngineConfig.fault_injection is set
(tests only, through the hidden `--fault-injection STAGE:PREFIX` flag), and costs nothing when off.
"""
from __future__ import annotations

STAGES = ("prepare", "postprocess", "loop")  # runner inputs, the core's token bookkeeping, the engine loop


class RequestError(RuntimeError):
    """A step failed because of this request only."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id


class FaultInjector:
    """Raises RequestError at `stage` for requests whose id starts with `prefix` (spec "stage:prefix")."""

    def __init__(self, spec: str | None):
        self.stage, self.prefix = None, ""
        if spec:
            stage, sep, prefix = spec.partition(":")
            if stage not in STAGES or not sep or not prefix:
                raise ValueError(f"fault_injection must be 'STAGE:REQUEST_ID_PREFIX' with STAGE in {STAGES}, "
                                 f"got {spec!r}")
            self.stage, self.prefix = stage, prefix

    def __bool__(self) -> bool:
        return self.stage is not None

    def check(self, stage: str, request_id: str) -> None:
        if stage == self.stage and request_id.startswith(self.prefix):
            raise RequestError(request_id, f"fault injected at {stage} (test hook)")

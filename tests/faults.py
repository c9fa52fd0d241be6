"""Test-only fault injection: requests whose id starts with PREFIX fail at STAGE (spec "STAGE:PREFIX").

The package carries no hook: install() patches the engine's classes from outside. For a `novainfer serve`
subprocess, tests/fault_server.py installs it in the engine core process from NOVAINFER_TEST_FAULT.
"""

from __future__ import annotations

from typing import Any, Callable

from novainfer.engine.faults import RequestError

STAGES = ("prepare", "postprocess", "loop")  # runner inputs, the core's token bookkeeping, the engine loop


def parse(spec: str) -> tuple[str, str]:
    """(stage, prefix) of "STAGE:PREFIX"."""
    stage, sep, prefix = spec.partition(":")
    if stage not in STAGES or not sep or not prefix:
        raise ValueError(f"a fault is 'STAGE:REQUEST_ID_PREFIX' with STAGE in {STAGES}, got {spec!r}")
    return stage, prefix


def install(spec: str, setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
    """Patch the stage's method so that it raises RequestError for matching requests (setattr_: a
    monkeypatch's setattr, to undo it after the test)."""
    stage, prefix = parse(spec)

    def check(request_id: str) -> None:
        if request_id.startswith(prefix):
            raise RequestError(request_id, f"fault injected at {stage} (test hook)")

    if stage == "prepare":  # before any of the step's inputs is written
        from novainfer.worker.model_runner import ModelRunner

        real_prepare = ModelRunner.prepare_step_inputs

        def prepare(self, sched):
            for s in sched.scheduled:
                check(s.seq.request_id)
            return real_prepare(self, sched)

        setattr_(ModelRunner, "prepare_step_inputs", prepare)
    elif stage == "postprocess":  # while the core applies a sampled token
        from novainfer.engine.core import EngineCore

        real_append = EngineCore._append_token

        def append(self, seq, token_id):
            check(seq.request_id)
            return real_append(self, seq, token_id)

        setattr_(EngineCore, "_append_token", append)
    else:  # the core process's loop, outside step()'s guard: kills the loop
        from novainfer.engine.core_proc import EngineCoreProc

        real_send = EngineCoreProc._send

        def send(self, outputs):
            for out in outputs.outputs:
                check(out.request_id)
            return real_send(self, outputs)

        setattr_(EngineCoreProc, "_send", send)

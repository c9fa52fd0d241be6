"""The server's request lifecycle (TrackedRequest). The engine loop's failure handling is tested against a real
server in test_server_faults.py."""

import logging

import pytest

from novainfer.engine.output_processor import RequestStatus
from novainfer.server.async_engine import IllegalTransitionError, TrackedRequest


def test_lifecycle_refuses_and_logs_illegal_transitions(caplog):
    tracked = TrackedRequest("r1", "r1", queue=None)
    tracked.transition(RequestStatus.RUNNING)
    tracked.transition(RequestStatus.RUNNING)  # more output while running is not a transition
    tracked.transition(RequestStatus.FINISHED)
    with caplog.at_level(logging.WARNING), pytest.raises(IllegalTransitionError):
        tracked.transition(RequestStatus.CANCELLED)
    assert "request_id=r1 illegal transition finished -> cancelled" in caplog.text
    assert tracked.status == RequestStatus.FINISHED
    with pytest.raises(IllegalTransitionError):
        TrackedRequest("r2", "r2", queue=None).transition(RequestStatus.QUEUED)

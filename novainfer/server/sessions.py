"""SessionStore: a conversation's history kept on the server under a client-chosen session_id.

A chat turn sent with a session_id continues the stored conversation, so its prompt starts with the
previous turn's tokens and hits the prefix cache. The store is bounded: least recently used sessions
are dropped past max_sessions, and idle ones expire after ttl seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Session:
    messages: list[dict] = field(default_factory=list)  # chat history, assistant replies included
    token_ids: list[int] = field(default_factory=list)  # completions history: prompts and outputs
    record: dict | None = None  # a stored API object (a Responses API response), returned as kept
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, max_sessions: int = 1024, ttl: float = 3600.0):
        self.max_sessions = max_sessions
        self.ttl = ttl
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session:
        """The live session with this id (a fresh one when unknown or expired), marked most recent."""
        self._expire()
        session = self._sessions.pop(session_id, None) or Session()
        session.last_used = time.monotonic()
        self._sessions[session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session

    def find(self, session_id: str) -> Session | None:
        """The live session with this id, marked most recent; None when unknown or expired (nothing is made)."""
        self._expire()
        session = self._sessions.get(session_id)
        if session is not None:
            session.last_used = time.monotonic()
            self._sessions.move_to_end(session_id)
        return session

    def discard(self, session_id: str) -> bool:
        """Forget the session; whether it was there."""
        return self._sessions.pop(session_id, None) is not None

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        while self._sessions:
            oldest_id, oldest = next(iter(self._sessions.items()))
            if oldest.last_used >= cutoff:
                return
            del self._sessions[oldest_id]


def continue_conversation(history: list[dict], messages: list[dict]) -> list[dict]:
    """The whole conversation for this turn: the client may resend the history or send only new messages."""
    if history and messages[: len(history)] == history:
        return list(messages)
    return history + list(messages)

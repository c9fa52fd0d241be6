"""SessionStore bounds (LRU count, idle expiry) and how a turn continues a stored conversation."""

import time

from novainfer.server.sessions import SessionStore, continue_conversation


def test_least_recently_used_session_is_dropped_past_the_bound():
    store = SessionStore(max_sessions=2, ttl=60)
    store.get("a").messages.append({"role": "user", "content": "1"})
    store.get("b")
    store.get("a")  # a is now the most recent
    store.get("c")  # evicts b
    assert len(store) == 2
    assert store.get("a").messages == [{"role": "user", "content": "1"}]
    assert store.get("b").messages == []  # b came back empty


def test_idle_sessions_expire():
    store = SessionStore(max_sessions=10, ttl=0.05)
    store.get("a").token_ids.extend([1, 2, 3])
    time.sleep(0.1)
    store.get("b")
    assert len(store) == 1 and store.get("a").token_ids == []


def test_turn_may_send_only_new_messages_or_the_whole_history():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    new = [{"role": "user", "content": "more"}]
    assert continue_conversation(history, new) == history + new
    assert continue_conversation(history, history + new) == history + new
    assert continue_conversation([], new) == new

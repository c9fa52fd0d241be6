"""The engine's per-token logprobs in OpenAI's two shapes (chat's `content` list, completions' columns)."""
from __future__ import annotations

from novainfer.outputs import Logprob


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> dict | None:
    """{"content": [{token, logprob, bytes, top_logprobs}]} for the given sampled tokens."""
    if not token_ids:
        return None
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry[tid]
        content.append({"token": _text(lp), "logprob": lp.logprob, "bytes": list(_text(lp).encode()),
                        "top_logprobs": [{"token": _text(t), "logprob": t.logprob, "bytes": list(_text(t).encode())}
                                         for _, t in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        text_offset: int = 0) -> dict | None:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the given sampled tokens."""
    if not token_ids:
        return None
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        lp = entry[tid]
        out["tokens"].append(_text(lp))
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_text(t): t.logprob for _, t in _top(entry, k)})
        out["text_offset"].append(text_offset)
        text_offset += len(_text(lp))
    return out

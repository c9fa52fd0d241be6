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
        content.append(
            {
                "token": _text(lp),
                "logprob": lp.logprob,
                "bytes": list(_text(lp).encode()),
                "top_logprobs": [
                    {"token": _text(t), "logprob": t.logprob, "bytes": list(_text(t).encode())}
                    for _, t in _top(entry, k)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int, text_offset: int = 0
) -> dict | None:
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


def prompt_completion_logprobs(
    prompt_ids: list[int], entries: list[dict[int, Logprob] | None], k: int, tokenizer
) -> dict:
    """The prompt's tokens in completions' column shape for `echo`: the first has no logprob (null), as OpenAI."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, entry in zip(prompt_ids, entries):
        text = entry[tid].decoded_token if entry else tokenizer.decode([tid])
        out["tokens"].append(text)
        out["token_logprobs"].append(entry[tid].logprob if entry else None)
        out["top_logprobs"].append({_text(t): t.logprob for _, t in _top(entry, k)} if entry else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def join_completion_logprobs(first: dict, second: dict | None, shift: int) -> dict:
    """Columns of `second` (its text offsets moved by shift characters) appended to `first`."""
    if second is None:
        return first
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]],
    }


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """The `prompt_logprobs` extra field in vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    return [
        None
        if e is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in e.items()
        }
        for e in entries
    ]

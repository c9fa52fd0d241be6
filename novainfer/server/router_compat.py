"""Fields that routers add to every request they forward, accepted at their no-op values.

sglang-router (SGLang Model Gateway) and vllm-router re-serialize OpenAI requests from their own typed structs,
so every forwarded body carries SGLang's extension fields at their defaults (e.g. "no_stop_trim": false,
"return_hidden_states": false). At exactly those values they ask for what this server does anyway, so they are
dropped before validation; any other value stays and is refused by validation, naming the field.
"""

from __future__ import annotations

import json

from novainfer.server.protocol import ChatCompletionRequest, CompletionRequest

ROUTER_DEFAULTS = {
    "no_stop_trim": False,
    "return_hidden_states": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "echo": False,
    "logprobs": False,
}
_MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def drop_router_defaults(path: str, body: bytes) -> bytes:
    """The body without router-added fields that the endpoint does not define and that hold their defaults."""
    model = _MODELS.get(path)
    if model is None or not any(k.encode() in body for k in ROUTER_DEFAULTS):
        return body
    try:
        data = json.loads(body)
    except ValueError:
        return body  # validation answers it
    if not isinstance(data, dict):
        return body
    drop = [
        k
        for k, default in ROUTER_DEFAULTS.items()
        if k not in model.model_fields and k in data and type(data[k]) is type(default) and data[k] == default
    ]
    if not drop:
        return body
    for k in drop:
        del data[k]
    return json.dumps(data).encode()

"""The messages between the front-end and the engine core, as msgspec structs encoded with msgpack.

Each message is a tagged struct, token ids travel as msgpack arrays of ints, and SamplingParams travels as
its dataclass fields (msgspec encodes dataclasses and enums), so a field added to it crosses without edits
here. A step's outputs for every request are one message. The one pickle is the tokenizer in the ready
message, sent once by the core the front-end started, over its private socket directory: transformers
cannot load a tokenizer without importing torch, which the front-end never does, and a pickle gives the
front-end the very object the core loaded (class, special tokens, chat template).

    front-end -> core   EngineCoreAdd (one request, tokenized), EngineCoreAbort (requests or single samples)
    core -> front-end   EngineCoreReady (once, after loading), EngineCoreOutputs (per step, with stats),
                        EngineCoreDead (the core's loop broke; it exits after sending it)
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from novainfer.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized request: what the core needs to schedule and sample it, no text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class AbortTarget(msgspec.Struct, array_like=True, omit_defaults=True):
    """A whole request (index None: cancelled) or one of its samples (a stop string ended it)."""

    request_id: str
    index: int | None = None


class EngineCoreAdd(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class EngineCoreAbort(msgspec.Struct, tag="abort", array_like=True):
    targets: list[AbortTarget]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sample's progress in one step: new token ids, their top logprobs, and its end if it ended
    at the token level (eos, a stop token id, max_tokens, the context's end, an error)."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    new_logprobs: list[list[tuple[int, float, int]]] | None = None  # per token: [(token_id, logprob, rank)]
    finish_reason: str | None = None  # "stop", "length", "error"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: list[Any] | None = None  # the prompt's logprobs, when asked for
    spec_num_draft_tokens: int = 0  # this sample's guesses verified so far (speculative decoding)
    spec_num_accepted_tokens: int = 0  # and accepted


class SchedulerStats(msgspec.Struct, array_like=True):
    """The core's gauges now and its cumulative counters, sent with every step's outputs."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_generation_tokens: int = 0
    spec_num_drafts: int = 0  # speculative decoding (spec_decode/stats.py): sequence-steps that verified guesses,
    spec_num_draft_tokens: int = 0  # guesses verified, accepted, and tokens those steps emitted
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineCoreReady(msgspec.Struct, tag="ready", array_like=True):
    """Sent once the model and the KV cache are loaded: what the front-end needs to validate requests."""

    pid: int
    max_model_len: int
    num_blocks: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: bytes  # the HF tokenizer, pickled (see the module docstring)


class EngineCoreDead(msgspec.Struct, tag="dead", array_like=True):
    reason: str


CoreInput = Union[EngineCoreAdd, EngineCoreAbort]
CoreOutput = Union[EngineCoreOutputs, EngineCoreReady, EngineCoreDead]


class MessageCodec:
    """Encodes what one side sends and decodes (checks) what it receives; a bad message raises
    msgspec.DecodeError / ValidationError, which the receiver logs and drops."""

    def __init__(self, receives: Any):
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(receives)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self.encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        return self.decoder.decode(data)


def request_id_of(data: bytes) -> str | None:
    """Best effort: the request id inside a message that failed to decode, for the log line."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:
        return None
    stack = [raw]
    while stack:  # the first string that is not a tag, depth first
        item = stack.pop()
        if isinstance(item, str) and item not in _TAGS:
            return item[:128]
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item[:8]))
        elif isinstance(item, dict):
            stack.extend(reversed([v for k, v in list(item.items())[:8] if k == "request_id"]))
    return None


_TAGS = {"add", "abort", "outputs", "ready", "dead"}

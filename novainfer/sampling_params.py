"""SamplingParams: how to pick each next token and when to stop, with vLLM's field names and defaults."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, fields

_GREEDY_EPS = 1e-5
_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # StructuredOutputsParams' constraints


class RequestOutputKind(enum.Enum):
    """What LLMEngine.step returns for a request: its output after every step, or only once it finishes."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One output constraint, as vLLM's StructuredOutputsParams: a JSON schema (dict or its JSON text), any JSON
    object, a regex, a choice among strings, or a Lark grammar. Exactly one is set. `after_tokens` (a thinking
    model's end-of-reasoning token ids) holds the constraint back until the output contains them."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    after_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if f.name in _KINDS and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    def key(self) -> str:
        """A stable text naming the constraint: the compiled-grammar cache's key."""
        kind = next(name for name in _KINDS if getattr(self, name) not in (None, False))
        return kind + ":" + json.dumps(getattr(self, kind), sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the model's room (max_model_len) runs out
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs to return with each sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (clamped to ±100)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # LLM.generate asks for FINAL_ONLY

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):  # anything else (a number, a dict) is refused, not iterated
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            setattr(self, name, list(value or []))
        if isinstance(self.structured_outputs, dict):  # as it arrives over a wire
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        for name, rng in RANGES.items():
            rng.check(name, getattr(self, name))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check_logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias} with ids as ints (JSON keys are strings) and biases clamped to [-100, 100] as OpenAI."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if tid < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"logit_bias must map token ids >= 0 to finite numbers, got {key!r}: {value!r}")
        out[tid] = max(-100.0, min(100.0, float(value)))
    return out


@dataclass(frozen=True)
class Range:
    """The values one numeric field accepts: a finite number (or integer) in [low, high], low excluded when
    low_open, None when nullable. SamplingParams checks them; the server's schema publishes the same bounds."""

    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    nullable: bool = False

    @property
    def upper(self) -> float | None:
        """high, or for an integer without one int64's largest: requests cross to the engine core in msgpack, which
        holds no larger integer."""
        return INT64_MAX if self.high is None and self.integer else self.high

    def check(self, name: str, value: object) -> None:
        """Raise ValueError naming the field when value has the wrong type or lies outside the range."""
        if value is None and self.nullable:
            return
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(f"{name} must be {'an integer' if self.integer else 'a number'}, got {value!r}")
        # NaN passes every comparison below (and would poison the logits); infinities are no setting either
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise ValueError(f"{name} must be {'>' if self.low_open else '>='} {self.low}, got {value}")
        if self.upper is not None and value > self.upper:
            raise ValueError(f"{name} must be <= {self.upper}, got {value}")

    def field_bounds(self) -> dict[str, float | bool]:
        """The range as pydantic Field keywords (ge/gt/le; finite floats only)."""
        bounds: dict[str, float | bool] = {} if self.integer else {"allow_inf_nan": False}
        if self.low is not None:
            bounds["gt" if self.low_open else "ge"] = self.low
        if self.upper is not None:
            bounds["le"] = self.upper
        return bounds


INT64_MAX = 2**63 - 1

RANGES: dict[str, Range] = {
    "n": Range(integer=True, low=1),
    "presence_penalty": Range(low=-2.0, high=2.0),
    "frequency_penalty": Range(low=-2.0, high=2.0),
    "repetition_penalty": Range(low=0.0, low_open=True),
    "temperature": Range(low=0.0),
    "top_p": Range(low=0.0, high=1.0, low_open=True),
    "top_k": Range(integer=True, low=-1),
    "min_p": Range(low=0.0, high=1.0),
    # a 64-bit generator seed; larger ones would fail the whole step
    "seed": Range(integer=True, low=-(2**63), high=INT64_MAX, nullable=True),
    "max_tokens": Range(integer=True, low=1, nullable=True),
    "min_tokens": Range(integer=True, low=0),
    "logprobs": Range(integer=True, low=0, nullable=True),
    "prompt_logprobs": Range(integer=True, low=0, nullable=True),
}

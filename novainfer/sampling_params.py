"""SamplingParams: how to pick each next token and when to stop, with vLLM's field names and defaults."""
from __future__ import annotations

import enum
from dataclasses import dataclass

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What LLMEngine.step returns for a request: its output after every step, or only once it finishes."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # LLM.generate asks for FINAL_ONLY

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check_number("n", self.n, integer=True, low=1)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_number("top_k", self.top_k, integer=True, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:  # a 64-bit generator seed; larger ones would fail the whole step
            _check_number("seed", self.seed, integer=True, low=-(2 ** 63), high=2 ** 63 - 1)
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True, low=1)
        _check_number("min_tokens", self.min_tokens, integer=True, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True, low=0)
        if self.prompt_logprobs is not None:
            _check_number("prompt_logprobs", self.prompt_logprobs, integer=True, low=0)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check_number(name: str, value, integer: bool = False, low: float | None = None,
                  high: float | None = None, low_open: bool = False) -> None:
    """Raise ValueError naming the field when value has the wrong type or lies outside [low, high]."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")

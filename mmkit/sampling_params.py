"""SamplingParams: vLLM's names and meanings, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request's output.

    `temperature=0` is greedy. `top_k` of -1 or 0 and `top_p=1` turn those filters off.
    `repetition_penalty` follows transformers (over prompt and output tokens);
    `presence_penalty` / `frequency_penalty` follow vLLM (over output tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until EOS, a stop condition or max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Filled by the engine from the tokenizer; not a user knob.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self.stop = _as_list("stop", self.stop, "a string or a list of strings", allow_str=True)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self._validate()
        if self.top_k == 0:
            self.top_k = -1

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        _int_at_least("n", self.n, 1)
        _float_in("temperature", self.temperature, 0.0, math.inf, "temperature >= 0 and finite")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: got {self.top_p!r}; expected 0 < top_p <= 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: got {self.top_k!r}; expected -1 or 0 (off) or a positive integer")
        _float_in("min_p", self.min_p, 0.0, 1.0, "0 <= min_p <= 1")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: got {self.seed!r}; expected an integer or None")
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "-2 <= presence_penalty <= 2")
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "-2 <= frequency_penalty <= 2")
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty: got {self.repetition_penalty!r}; expected a finite value > 0"
            )
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: got {self.min_tokens}; expected min_tokens <= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(name, value, 0)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop[{i}]: got {s!r}; expected a non-empty string")
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids[{i}]: got {t!r}; expected a non-negative int")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: got {getattr(self, name)!r}; expected True or False")

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes: Any) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _as_list(name: str, value: Any, expected: str, allow_str: bool = False) -> list:
    if value is None:
        return []
    if allow_str and isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: got {value!r} ({type(value).__name__}); expected {expected}")
    return list(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_in(name: str, value: Any, lo: float, hi: float, expected: str) -> None:
    if not (_is_number(value) and math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name}: got {value!r}; expected {expected}")


def _int_at_least(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: got {value!r}; expected an integer >= {lo}")

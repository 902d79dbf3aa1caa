"""SamplingParams and StructuredOutputsParams: vLLM's names and meanings, validated at construction."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
_KINDS = ("choice", "regex", "json", "json_object", "grammar")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `structured_outputs`), exactly one of:

    - `choice`: a list of strings; the output is exactly one of them.
    - `regex`: the output fully matches the regular expression.
    - `json`: a JSON schema (dict, JSON string, or a pydantic model class); the output parses
      and validates against it.
    - `json_object=True`: any JSON object.
    - `grammar`: a context-free grammar, xgrammar's EBNF (`root ::= ...`) or Lark.

    `disable_any_whitespace` (default True) makes JSON compact (`json.dumps` separators, no
    free whitespace), so a weak model cannot loop on spaces; False allows any whitespace.
    EOS is allowed exactly when the output is complete. Validated at construction: a bad
    regex, schema or grammar, an empty choice list or two kinds at once is a ValueError
    naming the field.
    """

    json: str | dict | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if not given:
            raise ValueError("StructuredOutputsParams: got no constraint; expected exactly one of "
                             + ", ".join(_KINDS))
        if len(given) > 1:
            raise ValueError(f"StructuredOutputsParams: got {' and '.join(given)} at once; expected exactly "
                             f"one of {', '.join(_KINDS)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace: got {self.disable_any_whitespace!r}; expected True or False")
        self._spec = self._build_spec(given[0])
        from mmkit.structured_outputs import spec as spec_lib  # imports xgrammar lazily

        error = spec_lib.check(self._spec)
        if error is not None:
            raise ValueError(f"{given[0]}: got {_short(getattr(self, given[0]))}; xgrammar rejects it: {error}")

    @property
    def kind(self) -> str:
        """Which constraint this is: choice, regex, json, json_object or grammar."""
        return next(k for k in _KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def spec(self):
        """The normalized `GrammarSpec` (kind, text, whitespace): the compile-cache key."""
        return self._spec

    def _build_spec(self, kind: str):
        from mmkit.structured_outputs.spec import JSON_OBJECT_SCHEMA, GrammarSpec, choice_ebnf, is_lark

        any_ws = not self.disable_any_whitespace
        if kind == "choice":
            if not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"choice: got {self.choice!r} ({type(self.choice).__name__}); expected a "
                                 "non-empty list of strings")
            if not self.choice:
                raise ValueError("choice: got an empty list; expected at least one string")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"choice[{i}]: got {c!r}; expected a non-empty string")
            self.choice = list(self.choice)
            return GrammarSpec("choice", choice_ebnf(self.choice), any_ws)
        if kind == "json_object":
            if self.json_object is not True:
                raise ValueError(f"json_object: got {self.json_object!r}; expected True")
            return GrammarSpec("json", JSON_OBJECT_SCHEMA, any_ws)
        if kind == "json":
            return GrammarSpec("json", _schema_text(self.json), any_ws)
        value = getattr(self, kind)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{kind}: got {_short(value)} ({type(value).__name__}); expected a non-empty string")
        if kind == "regex":
            return GrammarSpec("regex", value, any_ws)
        return GrammarSpec("lark" if is_lark(value) else "grammar", value, any_ws)


def _schema_text(schema: Any) -> str:
    """The schema as JSON text (property order kept: it is the order of the generated keys)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            parsed = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"json: got a string that is not JSON ({exc}); expected a JSON schema") from exc
        schema = parsed
    if not isinstance(schema, dict):
        raise ValueError(f"json: got {_short(schema)} ({type(schema).__name__}); expected a JSON schema "
                         "(a dict, a JSON string or a pydantic model class)")
    try:
        return _json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json: the schema is not JSON-serializable: {exc}") from exc


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    # mmkit extension: the first prompt position whose log-prob is wanted (negative: counted
    # from the end, -n = the last n tokens); earlier positions come back None and may be
    # served from the prefix cache (continuations scored after a shared context, e.g. the
    # options of a multiple-choice question).
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
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
        if isinstance(self.prompt_logprobs_start, bool) or not isinstance(self.prompt_logprobs_start, int):
            raise TypeError(f"prompt_logprobs_start: got {type(self.prompt_logprobs_start).__name__}; expected int")
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
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs: got {type(self.structured_outputs).__name__}; expected "
                            "StructuredOutputsParams or None")

    # ------------------------------------------------------------------ helpers
    def first_prompt_logprob(self, num_prompt_tokens: int) -> int:
        """The first prompt position whose log-prob is computed (`prompt_logprobs_start`)."""
        start = self.prompt_logprobs_start
        return max(num_prompt_tokens + start, 0) if start < 0 else start

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

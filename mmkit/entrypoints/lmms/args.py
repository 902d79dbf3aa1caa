"""`--model_args` values -> `LLM` keyword arguments.

lmms-eval 0.7.3 turns numbers and true/false into Python values and leaves everything else a
string, and it always passes `batch_size` (meaningless here: continuous batching takes every
request of a call at once; `max_num_seqs` bounds what runs together).
"""

from __future__ import annotations

import json
from typing import Any

# lmms-eval's own keywords: accepted, not engine arguments.
_LMMS_ONLY = ("batch_size", "device_map", "trust_remote_code")
# Options of the lmms-eval model itself (not EngineArgs), with their defaults.
MODEL_OPTIONS = {"max_new_tokens": 1024, "threads": None, "chat_template": None}


def parse_value(value: Any) -> Any:
    """A JSON-looking string (`{"image": 2}`, `[1, 2]`, `null`) as its value; others unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text[:1] in "{[" or text in ("null", "None"):
        try:
            return json.loads(text) if text != "None" else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--model_args: could not parse {value!r} as JSON: {exc}") from exc
    return value


def split_model_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine arguments for `LLM`, the model's own options)."""
    from mmkit.config import EngineArgs

    engine_fields = set(EngineArgs.__dataclass_fields__)
    engine: dict[str, Any] = {}
    options = dict(MODEL_OPTIONS)
    for key, value in kwargs.items():
        value = parse_value(value)
        if key in _LMMS_ONLY:
            continue
        if key in MODEL_OPTIONS:
            options[key] = value
        elif key in engine_fields:
            engine[key] = value
        else:
            raise ValueError(f"--model_args: unknown argument {key!r}; expected an mmkit engine argument "
                             f"({', '.join(sorted(engine_fields))}) or one of {sorted(MODEL_OPTIONS)}")
    return engine, options

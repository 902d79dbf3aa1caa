"""OpenAI request fields -> `StructuredOutputsParams`, for the server (one call per request).

Reads OpenAI's `response_format` (`{"type": "text" | "json_object" | "json_schema", ...}`),
vLLM's extra body `structured_outputs: {"choice" | "regex" | "json" | "grammar" |
"json_object": ...}` and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` extra fields. Pure: no engine, no xgrammar beyond the params' validation.
"""

from __future__ import annotations

from typing import Any, Mapping

from mmkit.sampling_params import StructuredOutputsParams

_SO_KEYS = ("choice", "regex", "json", "json_object", "grammar", "disable_any_whitespace")
_SO_IGNORED = ("disable_fallback",)  # vLLM backend-selection knob: mmkit has one backend
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_GUIDED_IGNORED = ("guided_decoding_backend",)


def structured_outputs_from_openai(response_format: Any = None, structured_outputs: Any = None,
                                   **guided: Any) -> StructuredOutputsParams | None:
    """The request's constraint, or None for free text.

    `response_format` and `structured_outputs` may be dicts or pydantic models (dumped by
    alias); `guided` holds vLLM's legacy `guided_*` fields. At most one source may constrain.
    Raises ValueError naming the field (`response_format.json_schema.schema: ...`).
    """
    sources = []
    rf = _as_dict("response_format", response_format)
    if rf is not None:
        params = _from_response_format(rf)
        if params is not None:
            sources.append(("response_format", params))
    so = _as_dict("structured_outputs", structured_outputs)
    if so is not None:
        sources.append(("structured_outputs", _from_structured_outputs(so)))
    legacy = {k: v for k, v in guided.items() if v is not None}
    unknown = [k for k in legacy if k not in _GUIDED and k not in _GUIDED_IGNORED]
    if unknown:
        raise TypeError(f"unexpected field(s) {unknown}; expected response_format, structured_outputs or "
                        f"{', '.join(_GUIDED)}")
    legacy_kinds = {_GUIDED[k]: v for k, v in legacy.items() if k in _GUIDED}
    if legacy_kinds:
        sources.append((", ".join(f"guided_{k}" for k in legacy_kinds), _build("guided", legacy_kinds)))
    if len(sources) > 1:
        raise ValueError(f"{sources[0][0]} and {sources[1][0]}: got two output constraints; expected at most one")
    return sources[0][1] if sources else None


def _as_dict(name: str, value: Any) -> dict | None:
    if value is None:
        return None
    if hasattr(value, "model_dump"):  # a pydantic request model
        value = value.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: got {type(value).__name__}; expected an object")
    return dict(value)


def _from_response_format(rf: dict) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type: got {kind!r}; expected 'text', 'json_object' or 'json_schema'")
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError(f"response_format.json_schema: got {spec!r}; expected an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"response_format.json_schema.name: got {name!r}; expected a non-empty string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"response_format.json_schema.strict: got {strict!r}; expected true, false or null")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise ValueError("response_format.json_schema.schema: missing; expected a JSON schema object")
    # NOTE: the schema is enforced whatever `strict` says (xgrammar never emits invalid JSON).
    return _build("response_format.json_schema.schema", {"json": schema}, field_name=False)


def _from_structured_outputs(so: dict) -> StructuredOutputsParams:
    unknown = [k for k in so if k not in _SO_KEYS and k not in _SO_IGNORED]
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]}: not supported; expected keys among "
                         f"{', '.join(_SO_KEYS)}")
    return _build("structured_outputs", {k: v for k, v in so.items() if k in _SO_KEYS})


def _build(where: str, kwargs: dict, field_name: bool = True) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if not field_name and message.startswith("json: "):
            message = message[len("json: "):]
        sep = "." if field_name and not message.startswith("StructuredOutputsParams") else ": "
        message = message.removeprefix("StructuredOutputsParams: ")
        raise ValueError(f"{where}{sep}{message}") from exc

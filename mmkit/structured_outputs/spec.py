"""A `StructuredOutputsParams` as one grammar spec: its kind, its text and its cache key.

Validation builds the xgrammar `Grammar` (no tokenizer needed), so a spec that constructs
is one the backend can compile; results are memoised by key, so 10,000 `SamplingParams`
with the same schema validate it once.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import NamedTuple

# xgrammar errors start with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarSpec(NamedTuple):
    """What the backend compiles. `kind` is one of json, regex, choice, grammar, lark;
    `text` is the schema JSON, regex, or grammar text; the tuple itself is the cache key."""

    kind: str
    text: str
    any_whitespace: bool


def xgrammar_message(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", first)


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: a JSON string literal is also a valid xgrammar EBNF literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """xgrammar's EBNF defines rules with `::=`; Lark (vLLM's other grammar syntax) with `:`."""
    return "::=" not in grammar


def build_grammar(spec: GrammarSpec):
    """The xgrammar `Grammar` of a spec (raises xgrammar's RuntimeError when invalid)."""
    import xgrammar as xgr

    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "lark":
        return xgr.Grammar.from_lark(spec.text)
    return xgr.Grammar.from_ebnf(spec.text)


@lru_cache(maxsize=1024)
def check(spec: GrammarSpec) -> str | None:
    """None when xgrammar accepts the spec, else its error message."""
    try:
        build_grammar(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError
        return xgrammar_message(exc)
    return None

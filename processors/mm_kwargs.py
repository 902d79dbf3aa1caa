"""Checking a family's `mm_processor_kwargs` (per engine and per request), one rule set each.

A family declares its keys as `{key: OptionRule}`; `check_mm_processor_kwargs` gives every
family the same errors: a TypeError for a non-dict, a ValueError naming unknown keys and the
allowed ones, and one naming the key, the value given and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


@dataclass(frozen=True)
class OptionRule:
    is_valid: Callable[[Any], bool]
    expected: str  # said in the error: "a positive integer", "True or False", ...


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


POSITIVE_INT = OptionRule(is_positive_int, "a positive integer")
POSITIVE_NUMBER = OptionRule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                             "a positive number")
BOOL = OptionRule(lambda v: isinstance(v, bool), "True or False")


def check_mm_processor_kwargs(where: str, kwargs: Any, rules: Mapping[str, OptionRule],
                              example: str) -> dict[str, Any]:
    """`kwargs` checked against `rules` (None = no options); `example` shows a valid dict."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{where}: got {type(kwargs).__name__}; expected a dict like {example}")
    unknown = [k for k in kwargs if k not in rules]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected only {list(rules)}")
    for key, value in kwargs.items():
        if not rules[key].is_valid(value):
            raise ValueError(f"{where}['{key}']: got {value!r}; expected {rules[key].expected}")
    return dict(kwargs)


def check_min_le_max(where: str, kwargs: Mapping[str, Any], low: str, high: str) -> None:
    """A range given as two options (min_pixels / max_pixels, min_patches / max_patches)."""
    if low in kwargs and high in kwargs and kwargs[low] > kwargs[high]:
        raise ValueError(f"{where}: got {low}={kwargs[low]} > {high}={kwargs[high]}; expected {low} <= {high}")


def integer_table(where: str, name: str, table: Any, meaning: str) -> list[list[int]]:
    """A given `[N, k]` integer tensor beside image embeddings (`image_grid_thw`, `image_sizes`;
    a single row may be 1-D) as rows of ints; `meaning` names the k columns, e.g. "t, h, w"."""
    width = len(meaning.split(","))
    if table.dtype.is_floating_point or table.dtype == torch.bool or table.is_complex():
        raise TypeError(f"{where}['{name}']: got dtype {table.dtype}; expected an integer tensor")
    rows = table.unsqueeze(0) if table.dim() == 1 else table
    if rows.dim() != 2 or rows.shape[1] != width or rows.shape[0] == 0:
        raise ValueError(f"{where}['{name}']: got shape {tuple(table.shape)}; expected [N, {width}] "
                         f"({meaning} per image)")
    return [[int(v) for v in row] for row in rows.tolist()]

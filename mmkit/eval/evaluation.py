"""Batch image+question evaluation: dataset reading, answer matching, resumable results.

The results file holds one JSON line per item, each written whole and flushed, so a run
killed at any moment loses at most the items in flight; rerunning with the same results
file skips the finished ones. The summary goes to its own JSON file beside it.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

_TRAILING = string.punctuation + " \t\n"


@dataclass
class EvalItem:
    index: int
    image: str  # path as written in the data file
    image_path: Path  # resolved relative to the data file
    question: str
    answers: list[str] | None
    qtype: str | None
    # Optional multiple-choice options: the answer is constrained to exactly one of them
    # (structured outputs) and scored by exact match.
    choices: list[str] | None = None
    # The data's own `id` column, when it has one (shown in the failure table, kept in results).
    item_id: str | None = None


def normalize_answer(text: str) -> str:
    """Lower case, no surrounding space, no trailing punctuation."""
    return text.strip().lower().rstrip(_TRAILING).strip()


def is_correct(answer: str, references: list[str]) -> bool:
    return any(normalize_answer(answer) == normalize_answer(ref) for ref in references)


def read_dataset(path: str | Path) -> list[EvalItem]:
    """JSONL or CSV with `image`, `question`, optional `answer` (JSONL: str or list), `type` and
    `choices` (JSONL: a list of strings; CSV: a JSON list or `|`-separated options)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"DATA: {str(path)!r} does not exist")
    with path.open(newline="", encoding="utf-8") as f:
        rows = parse_rows(f, path.name, is_csv=path.suffix.lower() == ".csv")
    return items_from_rows(rows, path.name, path.parent)


def parse_rows(f: Iterable[str], name: str, *, is_csv: bool) -> list[dict[str, Any]]:
    """The rows of an open text file: CSV (every value a string) or JSON lines."""
    if is_csv:
        return list(csv.DictReader(f))
    rows = []
    for lineno, line in enumerate(f, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"DATA: {name} line {lineno} is not JSON: {exc}") from exc
    return rows


def items_from_rows(rows: Iterable[dict[str, Any]], name: str, base: Path,
                    image_column: str = "image") -> list[EvalItem]:
    """Validated items; `image_column=None` when the images are bytes fetched separately."""
    items = []
    for i, row in enumerate(rows):
        for key in ((image_column, "question") if image_column else ("question",)):
            if not isinstance(row.get(key), str) or not row[key]:
                raise ValueError(f"DATA: {name} item {i} has no {key!r} column value; expected a string")
        answer = row.get("answer")
        if answer in (None, ""):
            answers = None
        elif isinstance(answer, list):
            answers = [str(a) for a in answer]
        else:
            answers = [str(answer)]
        qtype = row.get("type") or None
        image = row[image_column] if image_column else "<bytes>"
        item_id = row.get("id")
        items.append(EvalItem(i, image, (base / image), row["question"], answers,
                              str(qtype) if qtype is not None else None,
                              _read_choices(row.get("choices"), f"DATA: {name} item {i}"),
                              str(item_id) if item_id not in (None, "") else None))
    return items


def _read_choices(value: Any, where: str) -> list[str] | None:
    if value in (None, ""):
        return None
    if isinstance(value, str):  # a CSV cell
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: choices: got {value!r}, not a JSON list ({exc})") from exc
        else:
            value = [c.strip() for c in text.split("|")]
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"{where}: choices: got {value!r}; expected a non-empty list of non-empty strings")
    return value


def params_for(item: EvalItem, params):
    """The item's sampling params: constrained to its choices when it has some.

    NOTE: one optional space may precede the option. Chat models answer after "ASSISTANT:"
    with a space-prefixed token (" red" is one token, "red" two rare ones); forbidding that
    space pushes them off their distribution. The space is stripped before scoring. The
    grammar bounds the length, so max_tokens is lifted (a cut-off option would score wrong).
    """
    return choice_params(params, item.choices) if item.choices else params


def choice_params(params, choices: list[str]):
    """`params` constrained to one of `choices`, after one optional space (see `params_for`)."""
    from mmkit.sampling_params import StructuredOutputsParams
    from mmkit.structured_outputs.spec import choice_ebnf

    grammar = choice_ebnf(choices).replace("root ::= ", 'root ::= " "? (', 1) + ")"
    return params.clone(max_tokens=None, structured_outputs=StructuredOutputsParams(grammar=grammar))


class ResultsFile:
    """Append-only JSONL of item results that survives being killed at any moment."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[int, dict[str, Any]] = {}
        if self.path.exists():
            self._recover()
        self._file = None

    def _recover(self) -> None:
        """Read complete lines; drop a torn last line (from a kill mid-write) by rewriting."""
        good_lines = []
        torn = False
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    torn = True
                    continue
                try:
                    record = json.loads(line)
                    self.records[int(record["index"])] = record
                    good_lines.append(line)
                except (json.JSONDecodeError, KeyError, ValueError, TypeError):
                    torn = True
        if torn:
            self._rewrite(good_lines)

    def _rewrite(self, lines: Iterable[str]) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def drop(self, indices: set[int]) -> None:
        """Forget records (e.g. errors to retry), rewriting the file without them."""
        if not indices:
            return
        for i in indices:
            self.records.pop(i, None)
        self._rewrite(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records.values())

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        # One write call of a whole line, then flush: a kill never leaves half a line behind
        # that a rerun would not detect and drop.
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.records[int(record["index"])] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def make_record(item: EvalItem, answer: str | None, error: str | None) -> dict[str, Any]:
    correct = exact = None
    if answer is not None and item.answers:
        exact = answer in item.answers
        # Multiple choice is scored by exact match: the answer is one of the options verbatim.
        correct = exact if item.choices else is_correct(answer, item.answers)
    record = {"index": item.index, "image": item.image, "question": item.question, "type": item.qtype,
              "answer": answer, "reference": item.answers, "correct": correct, "exact_match": exact,
              "error": error}
    if item.choices:
        record["choices"] = item.choices
    if item.item_id is not None:
        record["id"] = item.item_id
    return record


@dataclass
class Summary:
    num_items: int = 0
    num_scored: int = 0
    num_errors: int = 0
    exact_match: float | None = None
    accuracy: float | None = None
    per_type: dict[str, dict[str, float | int]] = field(default_factory=dict)
    seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(records: Iterable[dict[str, Any]], seconds: float | None = None) -> Summary:
    records = list(records)
    summary = Summary(num_items=len(records), seconds=seconds)
    scored = [r for r in records if r.get("error") is None and r.get("reference")]
    summary.num_errors = sum(1 for r in records if r.get("error") is not None)
    summary.num_scored = len(scored)
    if scored:
        summary.exact_match = sum(bool(r.get("exact_match")) for r in scored) / len(scored)
        summary.accuracy = sum(bool(r.get("correct")) for r in scored) / len(scored)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for r in scored:
        if r.get("type"):
            by_type.setdefault(r["type"], []).append(r)
    for qtype, rows in sorted(by_type.items()):
        summary.per_type[qtype] = {"n": len(rows), "accuracy": sum(bool(r["correct"]) for r in rows) / len(rows)}
    return summary


def format_summary(summary: Summary) -> str:
    def pct(x: float | None) -> str:
        return "   n/a" if x is None else f"{100 * x:6.2f}%"

    lines = [f"items: {summary.num_items}   scored: {summary.num_scored}   errors: {summary.num_errors}",
             f"exact match:          {pct(summary.exact_match)}",
             f"normalised accuracy:  {pct(summary.accuracy)}"]
    if summary.per_type:
        lines.append(f"{'question type':20s} {'n':>6s} {'accuracy':>9s}")
        for qtype, row in summary.per_type.items():
            lines.append(f"{qtype:20s} {row['n']:6d} {pct(row['accuracy']):>9s}")
    return "\n".join(lines)


def summary_path_for(results: str | Path) -> Path:
    results = Path(results)
    return results.with_name(results.stem + ".summary.json")


def run_evaluation(llm, items: list[EvalItem], results: ResultsFile, build_inputs: Callable[[EvalItem], Any],
                   params, *, retry_errors: bool = False, show_progress: bool = True,
                   max_in_flight: int | None = None) -> Summary:
    """Push every unfinished item through one engine run; write each result as it finishes.

    Images are loaded as items are admitted (at most `max_in_flight` at once), so memory stays
    bounded; an item whose image cannot be loaded is recorded with its error and skipped.
    """
    from mmkit.engine.request_driver import ErrorPolicy, RequestDriver, drive
    from mmkit.errors import error_message
    from mmkit.eval.progress import progress_bar
    from mmkit.multimodal.parse import parse_prompt

    if retry_errors:
        results.drop({i for i, r in results.records.items() if r.get("error") is not None})
    todo = [it for it in items if it.index not in results.records]
    engine = llm.llm_engine
    by_id = {f"eval-{it.index}": it for it in todo}

    def prepare(item: EvalItem):
        return engine.process_request(f"eval-{item.index}", parse_prompt(item.index, build_inputs(item)),
                                      params_for(item, params))

    def on_error(rid: str, exc: BaseException) -> None:
        results.write(make_record(by_id[rid], None, error_message(exc)))
        bar.update(1)

    def on_output(out) -> None:
        item = by_id[out.request_id]
        text = out.outputs[0].text
        results.write(make_record(item, text.removeprefix(" ") if item.choices else text.strip(), None))
        bar.update(1)

    start = time.perf_counter()
    bar = progress_bar(len(todo), "Evaluating", "item", disable=not show_progress)
    try:  # per item: a bad item or an engine error is recorded on the items it hit; the rest run
        drive(RequestDriver(engine), ((rid, functools.partial(prepare, it)) for rid, it in by_id.items()),
              policy=ErrorPolicy.PER_ITEM, window=max_in_flight or max(2 * engine.config.scheduler.max_num_seqs, 64),
              on_output=on_output, on_error=on_error)
    finally:
        bar.close()
        results.close()
    return summarize(results.records.values(), time.perf_counter() - start)


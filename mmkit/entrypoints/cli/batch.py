"""Helpers of the `mmkit` command for many items: outputs in input order as they finish, the
table of failed eval items, and the one line a Ctrl-C prints instead of a traceback."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Iterable


def generate_in_order(llm, inputs: list[Any], params, on_output: Callable[[int, Any], None], *,
                      show_progress: bool) -> None:
    """Run `inputs` as one continuously batched engine run; call `on_output(i, RequestOutput)`
    in input order as soon as output i and every earlier one are done.

    Unlike `LLM.generate`, nothing waits for the whole batch, so an interrupted run has printed
    every answer finished before it. Every input is validated before any is added.
    """
    import functools

    from mmkit.engine.request_driver import ErrorPolicy, RequestDriver, drive
    from mmkit.errors import RequestFailedError
    from mmkit.eval.progress import progress_bar
    from mmkit.multimodal.parse import parse_prompt

    engine = llm.llm_engine
    ids = [f"cli-{i}" for i in range(len(inputs))]
    admissions = [(rid, functools.partial(engine.process_request, rid, parse_prompt(i, inp), params))
                  for i, (rid, inp) in enumerate(zip(ids, inputs))]
    index = {rid: i for i, rid in enumerate(ids)}
    done: dict[int, Any] = {}
    failed: dict[int, BaseException] = {}
    next_shown = 0

    def show_ready() -> None:
        nonlocal next_shown
        while next_shown in done:
            if done[next_shown] is not None:
                on_output(next_shown, done[next_shown])
            next_shown += 1

    def on_error(rid: str, exc: BaseException) -> None:
        failed[index[rid]] = exc
        done[index[rid]] = None
        bar.update(1)
        show_ready()

    def on_finished(out) -> None:
        done[index[out.request_id]] = out
        bar.update(1)
        show_ready()

    bar = progress_bar(len(ids), "Captioning", "image", disable=not show_progress)
    try:  # all-or-nothing, as LLM.generate: every input validated before any is added
        drive(RequestDriver(engine), admissions, policy=ErrorPolicy.ALL_OR_NOTHING,
              on_output=on_finished, on_error=on_error)
    finally:
        bar.close()
    if failed:
        raise RequestFailedError([done.get(i) for i in range(len(ids))], failed,
                                 {i: ids[i] for i in failed}) from failed[min(failed)]


def interrupted_message(args: argparse.Namespace) -> str:
    """`interrupted: N of M done; ...` for the command in `args` (what a Ctrl-C left on disk)."""
    prefix = f"mmkit {args.command}: interrupted"
    total = getattr(args, "num_items", None)
    if args.command == "eval" and total is not None:
        from mmkit.eval.evaluation import ResultsFile

        done = len(ResultsFile(args.output).records)
        return (f"{prefix}: {done} of {total} done (in {args.output}); "
                "run the same command again to resume")
    if args.command == "caption" and total is not None:
        return f"{prefix}: {args.num_done} of {total} images captioned (printed above)"
    return prefix


def format_failures(records: Iterable[dict[str, Any]], results_path: str | Path, limit: int = 20) -> str:
    """A short table of the items recorded with an error: index, id (the data's `id`, else its
    image) and the first line of the error; "" when none failed."""
    failed = sorted((r for r in records if r.get("error") is not None), key=lambda r: int(r["index"]))
    if not failed:
        return ""

    def cut(text: str, width: int) -> str:
        return text if len(text) <= width else text[:width - 3] + "..."

    lines = [f"failed items: {len(failed)} (full errors in {results_path})",
             f"{'index':>6s}  {'id':30s}  error"]
    for r in failed[:limit]:
        first_line = str(r["error"]).strip().splitlines()[0] if str(r["error"]).strip() else "(no message)"
        lines.append(f"{int(r['index']):6d}  {cut(str(r.get('id') or r.get('image') or ''), 30):30s}  "
                     f"{cut(first_line, 160)}")
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more")
    return "\n".join(lines)

"""Progress of a batch run: tqdm's bar on a terminal or in a notebook, plain lines in a log.

tqdm redraws its bar with carriage returns several times a second; when stderr is a file or a
pipe (a log, `nohup`, CI) every redraw lands in it. There the same progress is one plain line
every `interval_s` seconds, and one when the run ends:

    Evaluating: 40/100 items (40%), 12 s elapsed, about 18 s left
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

# Seconds between two plain progress lines.
LINE_INTERVAL_S = 10.0


def progress_bar(total: int, desc: str, unit: str, *, disable: bool = False, file: TextIO | None = None,
                 interval_s: float = LINE_INTERVAL_S) -> Any:
    """A progress object with tqdm's `update(n)` and `close()`: tqdm's bar when `file` (default
    stderr) is a terminal or the code runs in a notebook (its widget), else `LineProgress`."""
    from tqdm.auto import tqdm

    file = file if file is not None else sys.stderr
    if disable or not writes_lines(file):
        return tqdm(total=total, desc=desc, unit=unit, disable=disable, dynamic_ncols=True,
                    **({} if _in_notebook() else {"file": file}))
    return LineProgress(total, desc, unit, file=file, interval_s=interval_s)


def writes_lines(file: TextIO | None = None) -> bool:
    """Whether progress to `file` (default stderr) is plain lines: not a terminal, not a notebook."""
    file = file if file is not None else sys.stderr
    if _in_notebook():
        return False
    try:
        return not file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return True


def _in_notebook() -> bool:
    """tqdm.auto picked the notebook widget (a Jupyter kernel with ipywidgets)."""
    from tqdm.auto import tqdm

    return any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)


class LineProgress:
    """Prints `desc: n/total unit (pct), elapsed, about T left` at most every `interval_s`
    seconds as items finish, and a last line on `close()`."""

    def __init__(self, total: int, desc: str, unit: str, *, file: TextIO, interval_s: float = LINE_INTERVAL_S) -> None:
        self.total, self.desc, self.unit, self.file, self.interval_s = total, desc, unit, file, interval_s
        self.n = 0
        self.start = self.last_print = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_print >= self.interval_s and self.n < self.total:
            self.last_print = now
            self._print(now)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.n:
            self._print(time.monotonic())

    def _print(self, now: float) -> None:
        elapsed = now - self.start
        units = self.unit + ("s" if self.total != 1 and not self.unit.endswith("s") else "")
        line = f"{self.desc}: {self.n}/{self.total} {units}"
        if self.total:
            line += f" ({100 * self.n // self.total}%)"
        line += f", {elapsed:.0f} s elapsed"
        if 0 < self.n < self.total:
            line += f", about {elapsed / self.n * (self.total - self.n):.0f} s left"
        print(line, file=self.file, flush=True)

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

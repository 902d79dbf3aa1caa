"""Progress of batch runs: plain lines (not tqdm redraws) when stderr is not a terminal."""

import io

from mmkit.eval import progress
from mmkit.eval.progress import LineProgress, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_periodic_plain_lines_and_a_last_one(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    log = io.StringIO()
    bar = progress_bar(100, "Captioning", "image", file=log, interval_s=10)
    assert isinstance(bar, LineProgress)
    for _ in range(40):
        clock[0] += 0.1  # 40 images in 4 s: no line yet
        bar.update(1)
    assert log.getvalue() == ""
    clock[0] += 8  # 12 s in: the 41st image prints the line
    bar.update(1)
    bar.update(1)  # not again within the interval
    clock[0] += 3
    bar.update(58)
    bar.close()
    bar.close()
    assert log.getvalue().splitlines() == [
        "Captioning: 41/100 images (41%), 12 s elapsed, about 17 s left",
        "Captioning: 100/100 images (100%), 15 s elapsed",
    ]
    assert "\r" not in log.getvalue()


def test_a_terminal_gets_tqdm_and_disabled_prints_nothing():
    from tqdm.auto import tqdm

    terminal = _Terminal()
    bar = progress_bar(3, "Evaluating", "item", file=terminal)
    assert isinstance(bar, tqdm)
    bar.update(3)
    bar.close()
    assert "\r" in terminal.getvalue()
    log = io.StringIO()
    bar = progress_bar(3, "Evaluating", "item", file=log, disable=True)
    bar.update(3)
    bar.close()
    assert log.getvalue() == ""

"""benchmarks/: evidence folders named <YYYY-MM-DD>-<topic>, each one kept by .gitignore, and
every evidence path that benchmarks/README.md cites present in the tree (no model, no torch)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
FOLDER_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9-]*$")
# `results/<folder>/<file pattern>`, as the README writes it inside backticks.
CITED = re.compile(r"`(?:benchmarks/)?(results/[^`\s]+)`")


def _tracked_result_folders() -> set[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "benchmarks/results"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return {line.split("/")[2] for line in out.splitlines() if line.count("/") >= 3}


def _expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(head + alt + tail)]


def test_evidence_folders_are_named_by_date_and_topic_and_kept_by_gitignore():
    folders = _tracked_result_folders()
    assert folders, "no committed evidence under benchmarks/results"
    bad = sorted(f for f in folders if not FOLDER_NAME.match(f))
    assert not bad, f"evidence folders not named <YYYY-MM-DD>-<topic>: {bad}"
    probes = [f"benchmarks/results/{f}/figures.json" for f in sorted(folders)]
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", *probes],
                             capture_output=True, text=True).stdout.split()
    assert not ignored, f".gitignore ignores new files in evidence folders: {ignored}"
    # ... while a scratch output folder (a script's default --out) stays ignored.
    scratch = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "benchmarks/results/quant_compare/x.json"],
                             capture_output=True, text=True).stdout.split()
    assert scratch == ["benchmarks/results/quant_compare/x.json"]


def test_readme_opens_with_current_figures_then_method_and_points_to_history():
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[:2] == ["## Current figures", "## Method"], heads
    assert "HISTORY.md" in text.split("## Current figures")[0]
    assert (BENCH / "HISTORY.md").is_file()


def test_every_evidence_path_the_readme_cites_exists():
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    cited = [c for c in CITED.findall(text) if "<" not in c]  # not the naming rule's own `<YYYY-MM-DD>`
    assert len(cited) >= 10, cited
    missing = []
    for path in cited:
        folder = path.split("/")[1]
        assert FOLDER_NAME.match(folder), f"README cites an evidence folder with an old name: {path}"
        for one in _expand_braces(path.rstrip("/")):
            if not any(BENCH.glob(one)):
                missing.append(one)
    assert not missing, f"README cites evidence that is not in the tree: {missing}"

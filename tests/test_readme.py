"""Every code block of README.md and docs/*.md runs (or is checked) as written from the
repository root, so the pages cannot drift from the code.

Python blocks (```python): each runs alone in a fresh `python` subprocess (cwd: the repo root,
torch threads set, OpenMP not spinning), with a timeout; it must exit 0 and leave the clone's
`git status` unchanged (what it writes goes to a temp folder or is git-ignored). A block that
needs what it does not create (a real checkpoint, a running server) says so on its FIRST line,
`# needs: ...`, and is skipped by that rule only. docs/architecture.md's block is run by
tests/test_architecture_doc.py, not here (one run per block).

Shell blocks (```bash, ```sh, ```shell; in ```console blocks the `$ ` lines): the first line
decides what happens to the block:

- `# needs: ...` (network: pip from an index, `hf download`; a running server; a cluster; a
  real checkpoint): not run, only checked;
- `# not run: ...` (runs until stopped, as `mmkit serve` does, or is run by another test):
  not run, only checked;
- anything else: run as one `bash` script (`set -eo pipefail`), in a scratch folder that links
  every top-level entry of the repo (so `assets/...` resolves and outputs such as
  `results.jsonl` land in the scratch folder), with the Python blocks' environment, timeout and
  `git status` rule. A block with `--ray` or `import ray` is marked slow (Ray's start-up).

Checked means, for every command of every shell block (run or not): `mmkit ...` and
`python -m mmkit ...` parse with the command's own parser (`build_parser()` of
mmkit.entrypoints.cli.main; nothing runs), so every subcommand, flag and choice exists; every
other program is on PATH (`python -m X`: X is importable) unless an earlier `pip install` of
the same block installs it; `pip install -e ".[X]"` names extras that pyproject.toml defines,
and nothing installs `mmkit` by name (PyPI's `mmkit` is another project).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# Pages whose Python blocks another test runs (so they are not run twice).
RUN_ELSEWHERE = {"docs/architecture.md": "tests/test_architecture_doc.py"}
NEEDS = "# needs:"
NOT_RUN = "# not run:"
TOP_COMMANDS = ("pip install -e . && mmkit caption assets/scenes/red_circle.png",
                'pip install -e ".[test]" && python -m pytest -q')
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Blocks that start Ray (seconds of process start-up whatever the work) run with the slow tests.
_SLOW = ("import ray", "--ray")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_BUILTINS = {"cd", "export", "set", "source", "."}


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def blocks(text: str, langs: set[str]) -> list[tuple[int, str]]:
    """(line number, code) of each fenced block in one of `langs`, in order."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in _FENCE.finditer(text)
            if m.group(1) in langs]


def python_blocks(text: str) -> list[tuple[int, str]]:
    return blocks(text, {"python"})


def _first_line(code: str) -> str:
    return code.lstrip("\n").split("\n", 1)[0]


def _all_blocks(langs: set[str]) -> list[tuple[str, int, str]]:
    return [(_rel(page), line, code) for page in PAGES
            for line, code in blocks(page.read_text(encoding="utf-8"), langs)]


def _console_blocks() -> set[str]:
    return {code for _, _, code in _all_blocks({"console"})}


def _marks(code: str) -> list:
    runs = not _first_line(code).startswith((NEEDS, NOT_RUN))
    return [pytest.mark.slow] if runs and any(s in code for s in _SLOW) else []


def _python_params() -> list:
    return [pytest.param(code, id=f"{rel}:{line}", marks=_marks(code))
            for rel, line, code in _all_blocks({"python"}) if rel not in RUN_ELSEWHERE]


def _shell_params() -> list:
    return [pytest.param(code, id=f"{rel}:{line}", marks=_marks(code))
            for rel, line, code in _all_blocks(_SHELL_LANGS)]


# ---------------------------------------------------------------- shell lines -> commands

def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # "No closing quotation": the command goes on on the next line
        return True
    return False


def shell_lines(code: str, console: bool = False) -> list[str]:
    """The block's command lines, `\\`-continuations and multi-line quotes joined, comment lines
    dropped (console: only the `$ ` lines and their continuations)."""
    lines, current, taking = [], "", not console
    for raw in code.splitlines():
        if console and not current:
            taking = raw.startswith("$ ")
            raw = raw[2:] if taking else raw
        if not taking:
            continue
        if raw.rstrip().endswith("\\") and not _open_quote(current + raw.rstrip()[:-1]):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if _open_quote(current):
            current += "\n"
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            lines.append(current.strip())
        current = ""
    return lines


def commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at `&&`, `;`, `|`; comments and leading
    `VAR=value` assignments dropped), each as its argv."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out, argv = [], []
    for token in lexer:
        if token in _SEPARATORS:
            out.append(argv)
            argv = []
        else:
            argv.append(token)
    out.append(argv)
    cleaned = []
    for argv in out:
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv:
            cleaned.append(argv)
    return cleaned


def _mmkit_args(argv: list[str]) -> list[str] | None:
    """The arguments of an `mmkit ...` / `python -m mmkit ...` command, else None."""
    if argv[0] == "mmkit":
        return argv[1:]
    if argv[0] in ("python", "python3") and argv[1:3] == ["-m", "mmkit"]:
        return argv[3:]
    return None


def _parse_mmkit(args: list[str]) -> str | None:
    """None when mmkit's own parser accepts `args` (nothing runs), else its message."""
    from mmkit.entrypoints.cli.main import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):  # --help / --version exit 0
            return err.getvalue() or f"exit status {exc.code}"
    return None


def _extras() -> set[str]:
    """The extras pyproject.toml defines (read by hand: tomllib is Python 3.11+)."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", section, re.M))


def _pip_problems(argv: list[str]) -> list[str]:
    """What is wrong with a `pip install` command: unknown extras, mmkit by name."""
    problems = []
    for arg in argv[2:]:
        m = re.fullmatch(r"\.\[([^\]]*)\]", arg)
        if m:
            unknown = {e.strip() for e in m.group(1).split(",")} - _extras()
            if unknown:
                problems.append(f"{shlex.join(argv)}: no such extra {sorted(unknown)} in pyproject.toml")
        if re.fullmatch(r"mmkit(\[[^\]]*\])?([<>=!~].*)?", arg):
            problems.append(f"{shlex.join(argv)}: installs PyPI's unrelated `mmkit`; use -e \".[...]\" from a clone")
    return problems


def _program_problem(argv: list[str]) -> str | None:
    if argv[0] in _BUILTINS:
        return None
    if argv[0] in ("python", "python3") and len(argv) > 2 and argv[1] == "-m":
        if importlib.util.find_spec(argv[2]) is None:
            return f"{shlex.join(argv)}: no module {argv[2]!r}"
        return None
    if shutil.which(argv[0]) is None:
        return f"{shlex.join(argv)}: command not found: {argv[0]}"
    return None


def check_shell_block(code: str, console: bool = False) -> list[str]:
    """Every problem found in one shell block, without running it (see the module docstring)."""
    problems, installs = [], False
    for line in shell_lines(code, console):
        for argv in commands(line):
            if argv[:2] == ["pip", "install"] or argv[:4] == ["python", "-m", "pip", "install"]:
                problems += _pip_problems(argv if argv[0] == "pip" else argv[2:])
                installs = True
            args = _mmkit_args(argv)
            if args is not None:
                message = _parse_mmkit(args)
                if message:
                    problems.append(f"{shlex.join(argv)}: mmkit's parser refuses it:\n{message}")
            elif not installs:
                problem = _program_problem(argv)
                if problem:
                    problems.append(problem)
    return problems


# ---------------------------------------------------------------- the pages' structure

def test_the_pages_have_blocks_and_the_markers_are_first_line_only():
    readme = README.read_text(encoding="utf-8")
    assert len(python_blocks(readme)) >= 5 and len(blocks(readme, _SHELL_LANGS)) >= 5
    assert len(_all_blocks({"python"})) >= 15
    for rel, line, code in _all_blocks({"python"} | _SHELL_LANGS):
        later = code.strip("\n").split("\n")[1:]
        # A marker anywhere but the first line would not skip the block: a likely mistake.
        for marker in (NEEDS, NOT_RUN):
            assert not any(marker in x for x in later), f"{rel}:{line}: {marker!r} is read on a block's first line only"


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = README.read_text(encoding="utf-8")
    code_lines = [line[4:] for line in readme.splitlines() if line.startswith("    ")]
    assert tuple(code_lines[:2]) == TOP_COMMANDS
    first_section = readme.index("\n## ")
    assert all(readme.index(c) < first_section for c in TOP_COMMANDS)
    assert TOP_COMMANDS[1] in (REPO / ".ci" / "run").read_text().splitlines()
    for command in TOP_COMMANDS:
        assert not check_shell_block(command), check_shell_block(command)
    assert (REPO / "assets/scenes/red_circle.png").is_file()


def test_shell_commands_are_in_fenced_blocks():
    """An indented (unfenced) command would escape the shell checks; only the top two may be."""
    starts = ("mmkit ", "pip ", "python ", "curl ", "hf ", "huggingface-cli", "ray ", "jupyter ")
    for page in PAGES:
        text = _FENCE.sub("", page.read_text(encoding="utf-8"))
        for line in text.splitlines():
            if line.startswith("    ") and line.strip().startswith(starts) and line[4:] not in TOP_COMMANDS:
                pytest.fail(f"{_rel(page)}: a command outside a fenced bash block: {line.strip()!r}")


def test_inline_install_hints_work_from_a_clone():
    """`pip install ...` in running text names existing extras and never PyPI's `mmkit`."""
    problems = []
    for page in PAGES:
        for span in re.findall(r"`(pip install [^`]+)`", page.read_text(encoding="utf-8")):
            for argv in commands(span):
                if argv[:2] == ["pip", "install"]:
                    problems += [f"{_rel(page)}: {p}" for p in _pip_problems(argv)]
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_and_anchors_resolve():
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", text)):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{_rel(page)}: {target}: no such file")
                continue
            if anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", _FENCE.sub("", dest.read_text(encoding="utf-8")), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    problems.append(f"{_rel(page)}: {target}: no such heading in {dest.name}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- running the blocks

@pytest.fixture
def short_tmp():
    # A short path: the blocks' temp files go here (Ray's socket paths must stay under 108 bytes).
    path = tempfile.mkdtemp(prefix="readme-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(tmp: str) -> dict[str, str]:
    threads = os.environ.get("MMKIT_TEST_THREADS", "2")
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads, "MPLBACKEND": "Agg", "TMPDIR": tmp, "PYTHONUNBUFFERED": "1"}


def _untracked() -> set[str] | None:
    """Files in the clone that git neither tracks nor ignores (None outside a git checkout)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("?? ")}


def _run_and_check(argv: list[str], cwd: Path | str, tmp: str) -> None:
    before = _untracked()
    try:
        out = subprocess.run(argv, cwd=cwd, env=_env(tmp), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the block ran past 600 s:\n{exc.stdout}\n{exc.stderr}")
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-6000:]}"
    if before is not None:
        new = _untracked() - before
        assert not new, f"the block left files in the clone that .gitignore does not cover: {sorted(new)}"


@pytest.mark.parametrize("code", _python_params())
def test_python_block_runs(code, short_tmp):
    first = _first_line(code)
    if first.startswith(NEEDS):
        pytest.skip(first)
    _run_and_check([sys.executable, "-c", code], REPO, short_tmp)


@pytest.mark.parametrize("code", _shell_params())
def test_shell_block(code, request, short_tmp):
    console = code in _console_blocks()
    problems = check_shell_block(code, console=console)
    assert not problems, "\n".join(problems)
    first = _first_line(code)
    if first.startswith((NEEDS, NOT_RUN)):
        pytest.skip(f"checked, not run: {first}")
    # A scratch "clone root": every top-level entry of the repo, linked.
    scratch = Path(short_tmp) / "root"
    scratch.mkdir()
    for entry in REPO.iterdir():
        if entry.name != ".git":
            (scratch / entry.name).symlink_to(entry)
    script = "set -eo pipefail\n" + "\n".join(shell_lines(code, console)) + "\n"
    _run_and_check(["bash", "-c", script], scratch, short_tmp)


def test_gitignore_covers_what_the_readme_commands_write():
    """`--output X` of the pages' mmkit eval commands (and X's summary beside it) are git-ignored,
    for a user who runs them in the clone."""
    outputs = set()
    for _, _, code in _all_blocks(_SHELL_LANGS):
        for line in shell_lines(code):
            outputs |= set(re.findall(r"^mmkit eval .*?--output (\S+)", line))
    assert outputs, "the README shows mmkit eval --output"
    written = sorted(outputs | {str(Path(o).with_name(Path(o).stem + ".summary.json")) for o in outputs})
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == written, out.stdout

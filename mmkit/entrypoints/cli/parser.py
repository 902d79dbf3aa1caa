"""argparse for the `mmkit` command: no abbreviations, and a misspelt flag names the closest one.

argparse's defaults surprise a newcomer twice: `--max-token 5` is silently taken as
`--max-tokens` (prefix matching), and `mmkit ask IMG Q --max-tokns 5` is reported by the
top-level parser ("unrecognized arguments") with the top-level usage. Here every parser is
built with `allow_abbrev=False`, and an unknown flag is reported by the subcommand it was
given to, with that subcommand's usage and a "did you mean" from its own flags.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn, Sequence


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without abbreviations whose subparsers are `Parser`s too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        if self._subparsers is not None:
            # Flags before the command are the top-level parser's own (--help, --version): a
            # misspelt one is named here, not reported as "COMMAND is required".
            known = set(self.flags())
            for arg in args:
                if not arg.startswith("-") or arg == "--":
                    break
                if arg.startswith("--") and arg.split("=", 1)[0] not in known:
                    self.unknown_arguments([arg])
        if self._subparsers is None:
            # A misspelt flag first: otherwise "--outptu r" is reported as "--output is required".
            known = set(self.flags())
            for arg in args:
                if arg == "--":
                    break
                if arg.startswith("--") and arg.split("=", 1)[0] not in known:
                    self.unknown_arguments([arg])
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            # The leaf parser (a subcommand, or a parser without subcommands) reports its own
            # unknown arguments, so the usage shown is the one that holds the right flags.
            self.unknown_arguments(extras)
        return parsed, extras

    def unknown_arguments(self, extras: list[str]) -> NoReturn:
        first = extras[0]
        message = f"unrecognized arguments: {' '.join(extras)}"
        if first.startswith("-"):
            name = first.split("=", 1)[0]
            close = difflib.get_close_matches(name, self.flags(), n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
            else:
                message += f"; run '{self.prog} --help' for the flags"
        self.error(message)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

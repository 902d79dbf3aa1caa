"""`python -m mmkit` is the `mmkit` command."""

from mmkit.entrypoints.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

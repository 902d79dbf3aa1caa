"""`python -m mmkit` is the `mmkit` command."""

from mmkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

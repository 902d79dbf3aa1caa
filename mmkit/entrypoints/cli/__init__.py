"""The `mmkit` command: `main.py` (subcommands caption / ask / eval / serve), `parser.py`
(argparse without abbreviations), `batch.py` (many items: ordered output, failure table)."""

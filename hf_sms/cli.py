"""The ``hf-sms`` command: ``demo``, ``table``, ``merge``, ``inspect``."""

from __future__ import annotations

import argparse
import json
import sys

from . import checkpoint_cli, demo
from .results import format_table, reported_tests, speedup_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-sms", description="Sparse Model Soups for the Hugging Face ecosystem.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo.add_parser(sub)
    p = sub.add_parser("table", help="Print Table-1 shaped tables from results.json files (mean ± std over runs).")
    p.add_argument("results", nargs="+", help="results.json of one or more runs of the same setting (e.g. seeds)")
    p.add_argument("--split", nargs="*", help="val, test or named test sets (default: every test set)")
    p.set_defaults(func=_table)
    checkpoint_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _table(args) -> int:
    runs = []
    for path in args.results:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            print(f"hf-sms table: error: {path} is not a readable results.json ({e}); was its run killed while "
                  "writing? Leave it out or rerun that run", file=sys.stderr)  # fmt: skip
            return 2
    for split in args.split or reported_tests(runs[0]):
        print(f"{split}:\n{format_table(runs, split)}\n")
    print(speedup_report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

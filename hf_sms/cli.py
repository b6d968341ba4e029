"""The ``hf-sms`` command: ``demo``, ``merge``, ``inspect``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-sms", description="Sparse Model Soups for the Hugging Face ecosystem.")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import checkpoint_cli, demo

    demo.add_parser(sub)
    checkpoint_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

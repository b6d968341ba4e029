"""The ``hf-sms`` command: ``demo``, ``table``, ``timeline``, ``merge``, ``inspect``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import checkpoint_cli, demo
from .results import format_table, plot_timeline, reported_tests, speedup_report, timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-sms", description="Sparse Model Soups for the Hugging Face ecosystem.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo.add_parser(sub)
    p = sub.add_parser("table", help="Print Table-1 shaped tables from results.json files (mean ± std over runs).")
    p.add_argument("results", nargs="+", help="results.json of one or more runs of the same setting (e.g. seeds)")
    p.add_argument("--split", nargs="*", help="val, test or named test sets (default: every test set)")
    p.set_defaults(func=_table)
    p = sub.add_parser("timeline", help="Busy and idle time of every process of a run; draws RUN_DIR/timeline.png.")
    p.add_argument("run_dir", help="a run's output folder (holding results.json)")
    p.set_defaults(func=_timeline)
    checkpoint_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _read(command: str, path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"hf-sms {command}: error: {path} is not a readable results.json ({e}); was its run killed while "
              "writing? Leave it out or rerun that run", file=sys.stderr)  # fmt: skip
        return None


def _table(args) -> int:
    runs = [_read("table", path) for path in args.results]
    if None in runs:
        return 2
    for split in args.split or reported_tests(runs[0]):
        print(f"{split}:\n{format_table(runs, split)}\n")
    print(speedup_report(runs))
    return 0


def _timeline(args) -> int:
    run = _read("timeline", os.path.join(args.run_dir, "results.json"))
    if run is None:
        return 2
    try:
        rows = timeline(run)
    except ValueError as e:
        print(f"hf-sms timeline: error: {e}", file=sys.stderr)
        return 2
    world = run["world"]
    print(f"{world['processes']} process(es) in {world['groups']} group(s), {world['seconds']:.1f} s")
    print(f"{'rank':>4} {'group':>5} {'jobs':>4} {'training s':>10} {'waiting s':>9} {'shared s':>8} {'idle':>6}")
    for r in rows:
        print(f"{r['rank']:>4} {r['group'] if r['group'] is not None else '-':>5} {r['jobs']:>4} {r['train_s']:>10.1f} "
              f"{r['wait_s']:>9.1f} {r['shared_s']:>8.1f} {100 * r['idle']:>5.1f}%")  # fmt: skip
    picture = os.path.join(args.run_dir, "timeline.png")
    plot_timeline(run, picture)
    print(f"wrote {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``hf-sms merge`` and ``hf-sms inspect``: argument parsing and printing over :mod:`hf_sms.checkpoint`."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import FORMATS, STREAMING_METHODS, inspect_checkpoint, merge_checkpoints


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_report(report: dict) -> str:
    """The text of ``hf-sms inspect`` for a report of :func:`hf_sms.checkpoint.inspect_checkpoint`."""
    ratio = report["dense_weights_bytes"] / max(report["weights_bytes"], 1)
    lines = [
        f"directory:    {report['directory']}",
        f"model:        {report['library']} {report['architecture']}",
        f"format:       {report['format']}",
        f"size on disk: {_mb(report['size_on_disk'])} (weights {_mb(report['weights_bytes'])}, dense equivalent "
        f"{_mb(report['dense_weights_bytes'])}: {ratio:.1f}x compression)",
        f"sparsity:     {100 * report['sparsity']:.2f}% of {report['numel']:,} prunable weights "
        f"({report['nnz']:,} kept), mask {report['mask_hash']}, measured from the weights",
    ]
    if report["mismatches"]:
        lines.append("WARNING:      sparsity.json does not match the stored weights (edited by hand, or weights from")
        lines.append("              another save); the figures here are measured. Re-save the checkpoint to fix it.")
        lines += [f"              - {m}" for m in report["mismatches"]]
    for key in ("recipe", "metrics"):
        if report.get(key):
            lines.append(f"{key + ':':<13} {json.dumps(report[key])}")
    if report.get("how_to_load"):
        lines.append("how to load:")
        lines += [f"    {line}" if line else "" for line in report["how_to_load"].splitlines()]
    rows = report["per_tensor"]
    if rows:
        width = max(len(n) for n in rows)
        lines.append(f"\n{'tensor':<{width}}  {'shape':<20} {'sparsity':>9}  codec")
        for name, t in rows.items():
            shape = "x".join(map(str, t["shape"]))
            lines.append(f"{name:<{width}}  {shape:<20} {100 * t['sparsity']:>8.2f}%  {t['codec']}")
    return "\n".join(lines)


def _run_merge(args: argparse.Namespace) -> int:
    info = merge_checkpoints(args.inputs, args.output, args.method, args.format, args.overwrite)
    print(f"merged {len(args.inputs)} checkpoints into {args.output} ({args.format}, sparsity {info['sparsity']:.4f})")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.directory)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _guarded(run):
    def func(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ValueError as e:
            print(f"hf-sms {args.command}: error: {e}", file=sys.stderr)
            return 2

    return func


def add_parsers(subparsers) -> None:
    """Add the ``merge`` and ``inspect`` subcommands to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "merge",
        help="average checkpoint folders into a soup, streaming tensor by tensor",
        description="Uniform soup of checkpoints retrained under the same mask (e.g. hf-sms merge r1 r2 r3 "
        "--output soup). Greedy soups need an evaluation function: use hf_sms.greedy_soup in Python.",
    )
    p.add_argument("inputs", nargs="+", metavar="DIR", help="checkpoint folders (save_sparse or save_pretrained)")
    p.add_argument("--method", default="uniform", choices=STREAMING_METHODS, help="merge method (default: uniform)")
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="folder to write (not one of the inputs)")
    p.add_argument("--format", default="bitmask", choices=FORMATS, help="output format (default: bitmask)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=_guarded(_run_merge))

    q = subparsers.add_parser("inspect", help="format, size, measured sparsity and recipe of a checkpoint folder")
    q.add_argument("directory", metavar="DIR")
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.set_defaults(func=_guarded(_run_inspect))

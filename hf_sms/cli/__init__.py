"""The ``hf-sms`` command: every subcommand's arguments, and its code imported only when it runs.

``hf-sms --help`` and ``hf-sms inspect`` start without torch (:mod:`hf_sms.lazy`): each subcommand names the
function that runs it (``module:function``), imported after the arguments parse. A ``ValueError`` is the user's
input: printed as ``hf-sms CMD: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..checkpoint.constants import FORMATS  # file names and formats only: no torch
from ..checkpoint.integrity import CorruptionError  # no torch either


def _output(p: argparse.ArgumentParser, fmt: str, what: str) -> None:
    """The arguments of a command that writes a checkpoint folder: where, in which format, replacing or not."""
    p.add_argument("--output", "-o", required=True, metavar="DIR", help=f"folder to write (not {what})")
    p.add_argument("--format", default=fmt, choices=FORMATS, help=f"output format (default: {fmt})")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-sms", description="Sparse Model Soups for the Hugging Face ecosystem.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="SMS vs IMP on scikit-learn's digits, offline, in minutes on a CPU.")
    p.add_argument("--output-dir", default="demo-output", help="Where results.json, results.png and the soup go.")
    p.add_argument("--quick", action="store_true", help="A smaller setting (2 phases, m=2) for CI.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: small layers gain nothing more).")
    p.set_defaults(run="hf_sms.cli.demo:command")

    p = sub.add_parser("table", help="Print Table-1 shaped tables from results.json files (mean ± std over runs).")
    p.add_argument("results", nargs="+", help="results.json of one or more runs of the same setting (e.g. seeds)")
    p.add_argument("--split", nargs="*", help="val, test or named test sets (default: every test set)")
    p.set_defaults(run="hf_sms.records.results:table")
    p = sub.add_parser("timeline", help="Busy and idle time of every process of a run; draws RUN_DIR/timeline.png.")
    p.add_argument("run_dir", help="a run's output folder (holding results.json)")
    p.set_defaults(run="hf_sms.records.results:timeline_command")

    p = sub.add_parser(
        "merge",
        help="average checkpoint folders into a soup, streaming tensor by tensor",
        description="Uniform soup of checkpoints retrained under the same mask (e.g. hf-sms merge r1 r2 r3 "
        "--output soup); model_stock, ties and dare merge their updates from --base (the pruned model they were "
        "retrained from). Greedy soups need an evaluation function: use hf_sms.greedy_soup in Python.",
    )
    p.add_argument("inputs", nargs="+", metavar="DIR", help="checkpoint folders (save_sparse or save_pretrained)")
    p.add_argument("--method", default="uniform", help="a soup method that needs no validation data (default: uniform)")
    p.add_argument("--weights", type=float, nargs="+", help="one positive weight per input (normalised to sum 1)")
    p.add_argument("--base", metavar="DIR", help="the inputs' common start, for model_stock, ties and dare")
    p.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="a method option, e.g. density=0.2"
    )
    p.add_argument("--seed", type=int, default=0, help="the soup's random stream (dare's drop)")
    _output(p, "bitmask", "one of the inputs")
    p.set_defaults(run="hf_sms.cli.checkpoints:run_merge")

    p = sub.add_parser(
        "convert",
        help="re-save a checkpoint folder in another format (dense: a plain copy that loads without hf-sms)",
    )
    p.add_argument("directory", metavar="DIR")
    _output(p, "dense", "the input")
    p.set_defaults(run="hf_sms.cli.checkpoints:run_convert")

    p = sub.add_parser("inspect", help="format, size, measured sparsity and recipe of a checkpoint folder")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run="hf_sms.checkpoint.inspect:run_inspect")

    p = sub.add_parser(
        "speed",
        help="latency and memory of a saved soup, dense vs the sparse runtime",
        description="Loads the checkpoint, times it dense against hf_sms.to_sparse_runtime on a random input of "
        "the given shape (interleaved repeats, medians), and measures peak memory of each in a fresh process.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (text models)")
    p.add_argument("--image-size", type=int, default=None, help="image side (vision models; default: the model's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--layout", default="auto", choices=["auto", "csr"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-memory", action="store_true", help="skip the two fresh-process memory measurements")
    p.add_argument(
        "--peak-of", choices=["dense", "auto", "csr", "smaller", "dense-shapes"], help=argparse.SUPPRESS
    )  # the memory child
    p.set_defaults(run="hf_sms.cli.checkpoints:run_speed")
    return parser


def command(name: str):
    """The function a subcommand's ``run`` names (``"module:function"``), imported now."""
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(command(args.run)(args) or 0)
    except ValueError as e:  # exit 1: corrupted (bytes or files not what the folder records); 2: anything else
        print(f"hf-sms {args.command}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, CorruptionError) else 2
    except OSError as e:  # unreadable file or folder (permissions, a dangling link, a file gone mid-read)
        what = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        print(f"hf-sms {args.command}: error: cannot read {what}; check the path and its permissions", file=sys.stderr)
        return 2

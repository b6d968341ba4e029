"""``hf-sms merge``, ``hf-sms convert`` and ``hf-sms speed`` (their arguments: :mod:`hf_sms.cli`): what they run
over :mod:`hf_sms.checkpoint` and :mod:`hf_sms.runtime`, and what they print."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
from accelerate import init_empty_weights

from ..checkpoint import (
    SparseCheckpoint,
    load_sparse,
    merge_checkpoints,
)
from ..checkpoint.folder import read_sparsity
from ..checkpoint.merge import convert_checkpoint
from ..checkpoint.shrink_record import ShrinkRecord
from ..runtime.speed import format_measured, measure_speedup, time_smaller
from ..shrinking.shrink import dense_shaped


def run_merge(args: argparse.Namespace) -> int:
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = float(value)
        except ValueError:
            raise ValueError(f"--option {item!r}: write KEY=NUMBER, e.g. --option density=0.2") from None
    info = merge_checkpoints(
        args.inputs,
        args.output,
        args.method,
        args.format,
        args.overwrite,
        args.weights,
        base=args.base,
        options=options,
        seed=args.seed,
    )
    print(f"merged {len(args.inputs)} checkpoints into {args.output} ({args.format}, sparsity {info['sparsity']:.4f})")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    convert_checkpoint(args.directory, args.output, args.format, args.overwrite)
    print(f"{args.output}: {args.format} copy of {args.directory}")
    return 0


def sample_input(directory: str, batch_size: int = 1, seq_len: int = 32, image_size: int | None = None):
    """A random input of the shape a checkpoint's model takes: token ids (encoder and decoder for seq2seq
    models) for transformers text models, images for vision models (timm's ``input_size`` unless given)."""
    ckpt = SparseCheckpoint(directory)
    g = torch.Generator().manual_seed(0)
    config = ckpt.config or {}
    for name, value in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--image-size", image_size or 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    longest = config.get("max_position_embeddings") or config.get("n_positions")
    if longest and seq_len > longest:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {longest} positions; give at most {longest}")
    main_input = _main_input(ckpt) if ckpt.library == "transformers" else None
    if main_input not in (None, "input_ids", "pixel_values"):
        raise ValueError(
            f"{ckpt.architecture} takes {main_input!r}, and hf-sms speed makes token ids or images only: time it in "
            "Python with hf_sms.runtime.measure_speedup(model, sample_input) on an input of your own"
        )
    if ckpt.library == "transformers" and "vocab_size" in config and main_input != "pixel_values":
        ids = torch.randint(0, config["vocab_size"], (batch_size, seq_len), generator=g)
        return {"input_ids": ids, "decoder_input_ids": ids} if config.get("is_encoder_decoder") else {"input_ids": ids}
    if ckpt.library == "torch":
        raise ValueError(
            f"{directory} holds a plain torch model, which needs a template to load: time it in Python with "
            "hf_sms.runtime.measure_speedup(model, sample_input)"
        )
    size = image_size or (config.get("pretrained_cfg", {}).get("input_size") or [3, 224, 224])[-1]
    if ckpt.library == "transformers":
        size = image_size or config.get("image_size", size)
    channels = config.get("in_channels", 3)
    return torch.randn(batch_size, channels, size, size, generator=g)


def _main_input(ckpt) -> str | None:
    """The input a transformers architecture reads first (``input_ids``, ``pixel_values``, ``input_values`` ...)."""
    import transformers

    cls = getattr(transformers, str(ckpt.architecture), None)
    return getattr(cls, "main_input_name", None) if isinstance(cls, type) else None


def _hwm_mb() -> float:
    """This process's peak resident memory (VmHWM, Linux; ru_maxrss would carry a parent's over exec)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


def _run_peak(args: argparse.Namespace) -> int:
    """The child of ``hf-sms speed``: load the soup one way, run it once, print peak memory before and after."""
    torch.set_num_threads(args.threads)
    before = _hwm_mb()
    x = sample_input(args.directory, args.batch_size, args.seq_len, args.image_size)
    if args.peak_of == "dense-shapes":  # a structured soup's dense shapes, built from its record (no weights read)
        ckpt = SparseCheckpoint(args.directory)
        with init_empty_weights(include_buffers=False):
            skeleton = ckpt.family.instantiate(ckpt)
        model = dense_shaped(skeleton, ShrinkRecord.of(ckpt.info).dense_config, device="cpu")
    else:
        runtime = None if args.peak_of in ("dense", "smaller") else args.peak_of
        model = load_sparse(args.directory, runtime=runtime, sample_input=x if runtime == "auto" else None)
    with torch.inference_mode():
        model(**x) if isinstance(x, dict) else model(x)
    print(before, _hwm_mb())
    return 0


def _peak_mb(directory: str, mode: str, args: argparse.Namespace) -> float | None:
    """Peak RSS above imports (MB) of a fresh process that loads ``directory`` (dense or runtime) and runs once."""
    if not os.path.exists("/proc/self/status"):
        return None  # VmHWM is Linux's
    argv = ["speed", directory, "--peak-of", mode, "--threads", str(args.threads), "--batch-size", str(args.batch_size)]
    argv += ["--seq-len", str(args.seq_len)] + (["--image-size", str(args.image_size)] if args.image_size else [])
    out = subprocess.run([sys.executable, "-m", "hf_sms.cli", *argv], capture_output=True, text=True)
    if out.returncode:
        raise ValueError(f"measuring memory failed: {out.stderr.strip().splitlines()[-1:]}")
    before, after = map(float, out.stdout.split()[-2:])
    return after - before


def run_speed(args: argparse.Namespace) -> int:
    args.threads = torch.get_num_threads() if args.threads is None else args.threads
    for name in ("threads", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.peak_of:
        return _run_peak(args)
    torch.set_num_threads(args.threads)
    x = sample_input(args.directory, args.batch_size, args.seq_len, args.image_size)
    model = load_sparse(args.directory)
    shrunk = ShrinkRecord.of(read_sparsity(args.directory))
    if shrunk is not None and shrunk.smaller and shrunk.dense_config is not None:  # a structured soup
        record = time_smaller(dense_shaped(model, shrunk.dense_config), model, x, repeats=args.repeats)
        print(f"{args.directory}: the smaller model vs the dense shapes it was cut from (random weights)")
        print(f"latency:  {format_measured(record)}")
        if not args.no_memory:
            dense, smaller = (_peak_mb(args.directory, m, args) for m in ("dense-shapes", "smaller"))
            if dense is not None:
                print(
                    f"peak RSS above imports, build or load + one forward in a fresh process: {dense:.0f} MB dense "
                    f"shapes vs {smaller:.0f} MB smaller model (load_sparse)"
                )
        return 0
    record = measure_speedup(model, x, layout=args.layout, repeats=args.repeats)
    print(f"{args.directory}: dense vs sparse runtime ({args.layout})")
    print(f"latency:  {format_measured(record)}")
    print(f"weights:  {record['dense_weights_mb']:.2f} MB dense vs {record['runtime_weights_mb']:.2f} MB runtime")
    if not args.no_memory:
        dense, runtime = (_peak_mb(args.directory, m, args) for m in ("dense", args.layout))
        if dense is not None:
            print(
                f"peak RSS above imports, load + one forward in a fresh process: {dense:.0f} MB dense (load_sparse) "
                f"vs {runtime:.0f} MB runtime (load_sparse(runtime={args.layout!r}))"
            )
    return 0

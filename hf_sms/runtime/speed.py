"""Measured speedups: a pruned model timed dense against the sparse runtime on a real input, side by side.

A FLOP count says what sparse kernels could save; this says what the runtime gives on this machine. Every
record names the device, threads and input it was measured with.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Mapping

import torch
from accelerate.utils import send_to_device
from torch import nn

from ..batchnorm import forward_batch
from ..pruning.prunable import accepts_labels, parameter_count
from .convert import to_sparse_runtime
from .layers import weight_bytes
from .timing import time_pair_spread


def describe_input(sample) -> str:
    """A short description of a sample input's shapes, e.g. ``"input_ids 1x32"``."""
    if callable(sample) and not torch.is_tensor(sample):
        return "a callable workload"
    if isinstance(sample, Mapping):
        return ", ".join(f"{k} {'x'.join(map(str, v.shape))}" for k, v in sample.items() if torch.is_tensor(v))
    if isinstance(sample, (tuple, list)):
        return ", ".join(describe_input(s) for s in sample)
    return "x".join(map(str, sample.shape)) if torch.is_tensor(sample) else type(sample).__name__


@torch.no_grad()
def measure_speedup(
    model: nn.Module, sample_input, *, layout: str = "auto", repeats: int = 7, description: str | None = None
) -> dict:
    """Time ``model`` dense against a sparse-runtime copy of it on ``sample_input`` (the model is not changed).

    Args:
        model: a pruned (masked dense) model.
        sample_input: as in :func:`hf_sms.to_sparse_runtime` (a batch, or a callable ``fn(model)``).
        layout: the runtime layout to measure.
        repeats: interleaved timed repeats (medians).
        description: what the record names as its input (default: ``sample_input``'s shapes).

    Returns:
        ``{"speedup", "dense_ms", "runtime_ms", "device", "threads", "input", "layout", "sparse_layers",
        "dense_weights_mb", "runtime_weights_mb"}`` (JSON-able).
    """
    # A copy of the modules that shares every parameter and buffer (the runtime swaps modules, never writes a
    # weight): timing a soup costs the sparse weights the runtime keeps, not a second model.
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        runtime = to_sparse_runtime(copy.deepcopy(model, shared), layout, sample_input, repeats=repeats)
    finally:
        for p, flag in flags:  # the runtime freezes what it holds: the model's own parameters
            p.requires_grad_(flag)
    report = runtime.hf_sms_runtime
    return {
        "speedup": report.speedup,
        "speedup_range": report.speedup_range,
        "repeats": report.repeats,
        "dense_ms": report.dense_ms,
        "runtime_ms": report.runtime_ms,
        "device": report.device,
        "threads": report.threads,
        "input": description or describe_input(sample_input),
        "layout": layout,
        "sparse_layers": f"{len(report.sparse_layers)}/{len(report.layers)}",
        "dense_weights_mb": round(weight_bytes(model) / 2**20, 3),
        "runtime_weights_mb": round(weight_bytes(runtime) / 2**20, 3),
    }


def measure_speedup_of(model: nn.Module, batch) -> dict:
    """What a run records of a pruned model: timed on ``batch`` dense vs the sparse runtime
    (:func:`measure_speedup`), on the device ``model`` is on."""
    batch = send_to_device(batch, next(model.parameters()).device)  # once, outside the timed calls

    def forward(m):
        forward_batch(m, batch, keep_labels=accepts_labels(m))

    with warnings.catch_warnings():  # an early phase below the runtime's threshold: its record says 0 sparse
        warnings.filterwarnings("ignore", message="to_sparse_runtime: no layer")
        return measure_speedup(model, forward, description=describe_input(batch))


@torch.no_grad()
def time_smaller(dense: nn.Module, smaller: nn.Module, batch, *, repeats: int = 7, description: str | None = None):
    """``dense`` (shapes before shrinking) against ``smaller`` on ``batch``, side by side, in eval mode on the
    device ``dense`` is on: what the smaller model gives there.

    Returns:
        ``{"speedup", "dense_ms", "runtime_ms", "device", "threads", "input", "layout": "shrunk",
        "dense_parameters", "parameters"}`` (JSON-able; ``runtime_ms`` is the smaller model's).
    """
    device = next(dense.parameters()).device
    dense, smaller = dense.eval(), smaller.eval()
    batch = send_to_device(batch, device)
    keep = accepts_labels(dense)
    dense_ms, small_ms, spread = time_pair_spread(
        lambda: forward_batch(dense, batch, keep_labels=keep),
        lambda: forward_batch(smaller, batch, keep_labels=keep),
        repeats,
        device,
    )
    return {
        "speedup": dense_ms / small_ms,
        "speedup_range": spread,
        "repeats": repeats,
        "dense_ms": dense_ms,
        "runtime_ms": small_ms,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "input": description or describe_input(batch),
        "layout": "shrunk",
        "dense_parameters": parameter_count(dense),
        "parameters": parameter_count(smaller),
    }


def format_measured(record: dict | None) -> str:
    """One line for a measured-speedup record, or ``"not measured"``."""
    if not record or record.get("speedup") is None:
        return f"not measured ({record['error']})" if record and record.get("error") else "not measured"
    what = (
        f"the smaller model has {record['parameters']:,} of {record['dense_parameters']:,} parameters"
        if record.get("layout") == "shrunk"
        else f"{record['sparse_layers']} layers sparse"
    )
    spread = record.get("speedup_range")
    where = f"{record['device']}, {record['threads']} thread(s), input {record['input']}; {what}"
    if is_noise(record):  # the rounds disagree on which is faster, or by too much: no result to state
        return (
            f"no reliable speedup: the {record['repeats']} interleaved rounds range from {spread[0]:.2f}x to "
            f"{spread[1]:.2f}x (median {record['speedup']:.2f}x; {record['dense_ms']:.2f} ms dense vs "
            f"{record['runtime_ms']:.2f} ms); measure on a quieter machine or with more repeats ({where})"
        )
    spread = f", {spread[0]:.2f}-{spread[1]:.2f}x over {record['repeats']} interleaved rounds" if spread else ""
    times = f"{record['dense_ms']:.2f} ms dense vs {record['runtime_ms']:.2f} ms"
    return f"{record['speedup']:.2f}x ({times}{spread}; {where})"


NOISE_RATIO = 1.3  # rounds further apart than this (highest / lowest speedup) measure the machine, not the model


def is_noise(record: dict | None) -> bool:
    """A measured speedup whose rounds straddle 1.0 (faster in some, slower in others) or spread wider than
    :data:`NOISE_RATIO`: not a result."""
    spread = (record or {}).get("speedup_range")
    if not spread or record.get("speedup") is None:
        return False
    lo, hi = spread
    return lo < 1.0 < hi or (lo > 0 and hi / lo > NOISE_RATIO)

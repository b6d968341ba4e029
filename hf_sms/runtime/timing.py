"""Timing side by side: medians of interleaved repeats, so two workloads share the machine's noise."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(workloads: list[Callable[[], object]], repeats: int, device) -> list[float]:
    """Median milliseconds of each workload, timed side by side (interleaved, after one warm-up each)."""
    for fn in workloads:
        fn()
    times: list[list[float]] = [[] for _ in workloads]
    for _ in range(repeats):
        for fn, out in zip(workloads, times):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def time_pair(first: Callable[[], object], second: Callable[[], object], repeats: int, device) -> tuple[float, float]:
    """Median milliseconds of two workloads timed side by side (see :func:`median_ms`)."""
    a, b = median_ms([first, second], repeats, device)
    return a, b

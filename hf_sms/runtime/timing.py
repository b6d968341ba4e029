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
    return [statistics.median(t) for t in repeat_ms(workloads, repeats, device)]


def repeat_ms(workloads: list[Callable[[], object]], repeats: int, device) -> list[list[float]]:
    """Milliseconds of each workload in each of ``repeats`` interleaved rounds (after one warm-up each)."""
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
    return times


def time_pair(first: Callable[[], object], second: Callable[[], object], repeats: int, device) -> tuple[float, float]:
    """Median milliseconds of two workloads timed side by side (see :func:`median_ms`)."""
    a, b = median_ms([first, second], repeats, device)
    return a, b


def time_pair_spread(first, second, repeats: int, device) -> tuple[float, float, list[float]]:
    """``(median ms of first, median ms of second, [lowest, highest] ratio first / second of one round)``: the
    speedup with its spread over interleaved rounds."""
    a, b = repeat_ms([first, second], repeats, device)
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(a), statistics.median(b), [round(min(ratios), 3), round(max(ratios), 3)]

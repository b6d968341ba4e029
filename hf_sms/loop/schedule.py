"""Every process busy: which process group trains which job.

A run's tracks (the SMS trajectories, one per soup method, and the IMP baselines) advance phase by phase. On
several process groups, phase p of every track is one round: its training jobs (one per replica or IMP track) are
placed longest first on the group with the least work so far (LPT, Graham 1969), which is within 4/3 of the best
placement. Pure functions: every process computes the same placement, with no communication.
"""

from __future__ import annotations

import math


def job_steps(args, n_train: int) -> float:
    """What a replica of ``args`` trains, in optimizer steps (the schedule's cost of its job)."""
    if args.max_steps > 0:
        return float(args.max_steps)
    per_epoch = max(1, math.ceil(n_train / (args.per_device_train_batch_size * args.gradient_accumulation_steps)))
    return float(args.num_train_epochs) * per_epoch


def assign(costs: list[float], n_groups: int) -> list[int]:
    """The group of each job: longest first, each on the least loaded group (ties: the job listed first, the
    lowest group), so that equal jobs spread as round robin does."""
    return [groups[0] for groups in place(costs, n_groups)[0]]


def place(costs: list[float], n_groups: int, share: bool = False) -> tuple[list[list[int]], list[float]]:
    """``(groups of each job, its planned start)``: longest first on the least loaded group, as :func:`assign`;
    with ``share``, a job that finds more groups free at once than jobs left takes its share of them
    (data-parallel over several groups; the last job takes every free group)."""
    if n_groups < 1:
        raise ValueError(f"n_groups must be >= 1, got {n_groups}")
    load, groups, starts = [0.0] * n_groups, [[0]] * len(costs), [0.0] * len(costs)
    order = sorted(range(len(costs)), key=lambda j: -costs[j])
    for n, j in enumerate(order):
        t = min(load)
        free = [g for g in range(n_groups) if load[g] <= t + 1e-9 * max(t, 1.0)]
        left = len(order) - n
        take = free[: len(free) // left] if share and left < len(free) else free[:1]
        for g in take:
            load[g] = t + costs[j] / len(take)
        groups[j], starts[j] = take, t
    return groups, starts

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
    if n_groups < 1:
        raise ValueError(f"n_groups must be >= 1, got {n_groups}")
    load, groups = [0.0] * n_groups, [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):
        g = min(range(n_groups), key=lambda g: load[g])
        groups[j], load[g] = g, load[g] + costs[j]
    return groups

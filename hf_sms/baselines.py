"""Baselines reported beside SMS (docs/method.md §6), in a registry: ``fn(runner)`` runs one on a
:class:`hf_sms.sms.SparseModelSoup` and records its rows. A new baseline is one function and one line."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from .pruning import prune
from .registry import registrar
from .seeding import derive_seed

BASELINES: dict[str, Callable] = {}
register_baseline = registrar(BASELINES, "baseline")


@register_baseline("imp")
def imp(runner) -> None:
    """IMP: m = 1, the same retraining per phase as one replica."""
    if "imp_reprune" not in runner.args.baselines:  # IMP-RePrune's first track is this IMP run
        run_imp(runner, "imp", n_tracks=1)


@register_baseline("imp_mx")
def imp_mx(runner) -> None:
    """IMP_mx: m = 1, retrained with the compute SMS spends per phase (the sum over its replicas)."""
    run_imp(runner, "imp_mx", n_tracks=1, times_m=True)


@register_baseline("imp_reprune")
def imp_reprune(runner) -> None:
    """IMP-RePrune: m independent IMP runs (their masks diverge), averaged and re-pruned after each phase."""
    run_imp(runner, "imp", n_tracks=runner.args.num_replicas)


def run_imp(runner, name: str, n_tracks: int, times_m: bool = False) -> None:
    """IMP (m=1) trajectories, each with its own random stream, in lockstep and parallel like replicas; with
    several tracks also IMP-RePrune: their average, re-pruned to the phase's sparsity (their masks diverge)."""
    args, world = runner.args, runner.world
    tracks = {i: copy.deepcopy(runner.pretrained) for i in world.owned(n_tracks)}
    masks = dict.fromkeys(tracks)
    for p, sparsity in enumerate(runner.results["phases"]):
        for i in tracks:  # no mask broadcast: IMP runs are independent
            step = prune(tracks[i], sparsity, args.allocation, masks[i], example_inputs=runner.example)
            masks[i] = step.masks
            h = dataclasses.replace(args, seed=derive_seed(args.seed, name, p, i))
            if times_m:  # IMP_mx: the compute SMS spends in this phase, in one replica
                h = dataclasses.replace(h, **args.phase_budget(p))
            tracks[i] = runner.recalibrate(runner.train_replica(tracks[i], step, h, f"{name}/phase{p + 1}/track{i}"))
        runner.record_row(name, p, world.gather({0: runner.measure(tracks[0])} if 0 in tracks else {})[0])
        if n_tracks > 1:
            template = next(iter(tracks.values()))
            weights = [1 / n_tracks] * n_tracks
            reprune = runner.load(template, world.average(runner.state_dicts(tracks), weights, template.state_dict()))
            prune(reprune, sparsity, args.allocation, None, world.broadcast_masks, runner.example)
            runner.record_row("imp_reprune", p, runner.measure(runner.recalibrate(reprune)))

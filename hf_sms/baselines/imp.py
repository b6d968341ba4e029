"""The IMP baselines reported beside SMS (docs/method.md §6): IMP, IMP_mx and IMP-RePrune, each a registration in
:data:`hf_sms.registry.BASELINES` that runs ``fn(ctx)`` (the loop) and records its rows. All three are IMP tracks
through the loop's phase step: m = 1 per track, each track with its own random stream and its own mask, tracks in
parallel like replicas."""

from __future__ import annotations

import copy
import dataclasses

from ..phase import PhaseSpec, phase_folder
from ..registry import BASELINES
from ..seeding import derive_seed


def run_imp(ctx, name: str, n_tracks: int, times_m: bool = False) -> None:
    """IMP (m=1) tracks in lockstep; with several tracks also IMP-RePrune: their average, re-pruned to the phase's
    sparsity (their masks diverge)."""
    args, world = ctx.args, ctx.world
    tracks = {i: copy.deepcopy(ctx.pretrained) for i in world.owned(n_tracks)}
    masks: dict = {}
    for p, sparsity in enumerate(ctx.phases):
        hparams = []
        for i in range(n_tracks):
            h = dataclasses.replace(args, seed=derive_seed(args.seed, name, p, i))
            hparams.append(dataclasses.replace(h, **args.phase_budget(p)) if times_m else h)  # IMP_mx: SMS's compute
        reprune = "reprune" if n_tracks > 1 else None  # the tracks' average, re-pruned to the phase's sparsity
        spec = PhaseSpec(sparsity, tracks, masks, hparams, phase_folder(name, p), soup=reprune, member="track")
        result = ctx.run_phase(spec)  # no mask broadcast: IMP runs are independent
        tracks, masks = result.candidates, result.masks
        # track 0 on every process, which share its test sets (its owner scored validation already)
        first = tracks[0] if world.size == 1 else copy.deepcopy(ctx.pretrained)
        if world.size > 1:
            local = {i: t.state_dict() for i, t in tracks.items()}
            first.load_state_dict(world.from_owner(local, 0, ctx.pretrained.state_dict()))
        ctx.recorder.row(name, p, ctx.recorder.measure(first, val=result.val[0], shared=True))
        if result.soup is not None:
            ctx.recorder.row("imp_reprune", p, ctx.recorder.measure(result.soup, shared=True))


def _needs_two(config) -> None:
    if config.num_replicas < 2:
        raise ValueError(
            "baselines=['imp_reprune'] averages num_replicas independent IMP runs, so it needs num_replicas >= 2"
        )


@BASELINES.register("imp")
def imp(ctx) -> None:
    """IMP: m = 1, the same retraining per phase as one replica."""
    if "imp_reprune" not in ctx.args.baselines:  # IMP-RePrune's first track is this IMP run
        run_imp(ctx, "imp", n_tracks=1)


@BASELINES.register("imp_mx")
def imp_mx(ctx) -> None:
    """IMP_mx: m = 1, retrained with the compute SMS spends per phase (the sum over its replicas)."""
    run_imp(ctx, "imp_mx", n_tracks=1, times_m=True)


@BASELINES.register("imp_reprune", check=_needs_two)
def imp_reprune(ctx) -> None:
    """IMP-RePrune: m independent IMP runs (their masks diverge), averaged and re-pruned after each phase."""
    run_imp(ctx, "imp", n_tracks=ctx.args.num_replicas)

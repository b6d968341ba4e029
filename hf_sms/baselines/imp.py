"""The IMP baselines reported beside SMS (docs/method.md §6): IMP, IMP_mx, IMP with m phases and IMP-RePrune,
each a registration in :data:`hf_sms.registry.BASELINES` whose ``fn(ctx)`` (the loop) returns a track, a generator
of phases that records its rows (or ``None``: nothing to run). All are IMP tracks through the loop's phase step:
m = 1 per track, each track with its own random stream and its own mask; on several process groups they train
beside the SMS replicas (hf_sms.loop.rounds)."""

from __future__ import annotations

import copy
import dataclasses

from ..registry import BASELINES
from ..seeding import derive_seed
from ..soup.options import REPRUNE_SOUPS
from ..training.phase import PhaseSpec, TrackJob, phase_folder


def run_imp(ctx, name: str, n_tracks: int, times_m: bool = False, split: bool = False, callbacks=lambda: []):
    """IMP (m=1) tracks in lockstep; with several tracks also IMP-RePrune: their average, re-pruned to the phase's
    sparsity (their masks diverge). ``split``: each SMS phase p becomes m_p shorter IMP phases (:func:`sub_phases`),
    rows recorded where the SMS phases end. ``callbacks() -> [TrainerCallback]``: fresh ones for each phase's
    training (SWA). A track of the loop (:mod:`hf_sms.loop.rounds`): it yields each phase."""
    args, world = ctx.args, ctx.world
    phases, report = sub_phases(ctx.phases, [args.phase_replicas(p) for p in range(len(ctx.phases))], split)
    if n_tracks == 1 and world.n_groups > 1:  # a lone track: all its phases as one job, beside the other rounds
        hparams = [_hparams(args, name, p, 0, times_m) for p in range(len(phases))]
        result = yield TrackJob(name, hparams, lambda: _whole_track(ctx, name, hparams, phases, report, callbacks))
        for p, row in enumerate(result.rows):
            ctx.recorder.row(name, p, row)
        return
    template = ctx.pretrained.state_dict()
    # several tracks: IMP-RePrune, their average re-pruned to the phase's sparsity (plain, CIA, CAA: as asked)
    reprunes = [b for b in REPRUNE_SOUPS if b in args.baselines] if n_tracks > 1 else []
    soups = [REPRUNE_SOUPS[b] for b in reprunes]
    tracks = {i: ctx.copy_pretrained() for i in range(n_tracks)}
    masks: dict = {}
    for p, sparsity in enumerate(phases):
        hparams = [_hparams(args, name, p, i, times_m) for i in range(n_tracks)]
        folder, fresh = phase_folder(name, p), lambda i: {"callbacks": callbacks()}  # each training its own
        spec = PhaseSpec(sparsity, tracks, masks, hparams, folder, soups[0] if soups else None, member="track")
        spec.trainer_kwargs, spec.also = fresh, tuple(soups[1:])
        result = yield spec  # no mask broadcast: IMP runs are independent
        # every track and its mask on every process: the next phase may train it on another group
        local = {i: t.state_dict() for i, t in result.candidates.items()}
        local_masks = {i: {k: m.cpu() for k, m in ms.items()} for i, ms in result.masks.items()}
        for i in range(n_tracks):  # every process takes part in each broadcast; the owner keeps its own objects
            state, sent = world.from_owner(local, i, template), world.object_from_owner(local_masks, i)
            if i in result.candidates:
                tracks[i], masks[i] = result.candidates[i], result.masks[i]
            else:
                tracks[i], masks[i] = ctx.copy_pretrained(), sent
                tracks[i].load_state_dict(state)
        if p not in report:  # a sub-phase inside an SMS phase: no row
            continue
        # track 0's rows: every process holds it and shares its test sets (its owner scored validation already)
        ctx.recorder.row(name, report[p], ctx.recorder.measure(tracks[0], val=result.val[0], shared=True))
        for b in reprunes:
            merged = result.soup if REPRUNE_SOUPS[b] == spec.soup else result.also[REPRUNE_SOUPS[b]]
            ctx.recorder.row(b, p, ctx.recorder.measure(merged, shared=True))


def _hparams(args, name: str, p: int, i: int, times_m: bool):
    h = dataclasses.replace(args, seed=derive_seed(args.seed, name, p, i))
    return dataclasses.replace(h, **args.phase_budget(p)) if times_m else h  # IMP_mx: SMS's compute per phase


def _whole_track(ctx, name: str, hparams: list, phases: list[float], report: dict[int, int], callbacks) -> list[dict]:
    """Every phase of one IMP track on this process group, as the phase step does it (prune its own model, retrain,
    recalibrate, score), each row measured by the group: what run_imp's phases give on one process."""
    model, masks, rows, group = None, None, [], ctx.world.group
    for p, (sparsity, h) in enumerate(zip(phases, hparams)):
        start = ctx.copy_pretrained() if model is None else copy.deepcopy(model)
        step = ctx.args.plan.prune(start, sparsity, masks, ctx.example)
        model = ctx.train_replica(start, step, h, f"{phase_folder(name, p)}/track0", callbacks())
        model = ctx.recalibrate(model, group)
        if p in report:
            val = ctx.recorder.evaluate(model, ctx.eval_dataset, shared=group)
            rows.append(ctx.recorder.measure(model, val=val, shared=group))
        masks = step.masks
    return rows


def sub_phases(phases: list[float], m: list[int], split: bool = True) -> tuple[list[float], dict[int, int]]:
    """``(sparsity after each IMP phase, {IMP phase: the SMS phase it ends})``: with ``split``, SMS phase p (from
    s_{p-1} to s_p) becomes m_p phases that each remove the same fraction of the weights left, so the track passes
    through every SMS sparsity (with one m for all phases: the schedule of n x m phases). Without, the phases
    themselves."""
    if not split:
        return list(phases), {p: p for p in range(len(phases))}
    out, report, before = [], {}, 0.0
    for p, (after, k) in enumerate(zip(phases, m)):
        keep = (1.0 - after) / (1.0 - before)
        out += [1.0 - (1.0 - before) * keep ** (j / k) for j in range(1, k)] + [after]
        report[len(out) - 1], before = p, after
    return out, report


def _needs_two(config) -> None:
    if config.num_replicas < 2:
        asked = [b for b in REPRUNE_SOUPS if b in config.baselines]
        raise ValueError(f"baselines={asked} averages num_replicas independent IMP runs, so it needs num_replicas >= 2")


def _needs_more_phases(config) -> None:
    if max(config.phase_replicas(p) for p in range(config.n_phases)) < 2:
        raise ValueError("baselines=['imp_phases'] runs m IMP phases per SMS phase: with m = 1 it is 'imp'")


@BASELINES.register("imp")
def imp(ctx):
    """IMP: m = 1, the same retraining per phase as one replica."""
    if not _reprunes(ctx.args):  # IMP-RePrune's first track is this IMP run
        return run_imp(ctx, "imp", n_tracks=1)
    return None


@BASELINES.register("imp_mx")
def imp_mx(ctx):
    """IMP_mx: m = 1, retrained with the compute SMS spends per phase (the sum over its replicas)."""
    return run_imp(ctx, "imp_mx", n_tracks=1, times_m=True)


@BASELINES.register("imp_phases", check=_needs_more_phases)
def imp_phases(ctx):
    """IMP with m times as many phases (the paper's appendix): SMS's compute spent on more, shorter prune-retrain
    cycles, each as long as one replica's retraining; its rows where the SMS phases end."""
    return run_imp(ctx, "imp_phases", n_tracks=1, split=True)


def _reprunes(args) -> list[str]:
    return [b for b in REPRUNE_SOUPS if b in args.baselines]


def _imp_reprune(ctx, name: str):
    """m independent IMP runs (their masks diverge), run once for every IMP-RePrune asked for: the first one asked
    starts them, each records the merge it names."""
    return run_imp(ctx, "imp", n_tracks=ctx.args.num_replicas) if _reprunes(ctx.args)[0] == name else None


@BASELINES.register("imp_reprune", check=_needs_two)
def imp_reprune(ctx):
    """IMP-RePrune: m independent IMP runs (their masks diverge), averaged and re-pruned after each phase."""
    return _imp_reprune(ctx, "imp_reprune")


@BASELINES.register("imp_reprune_cia", check=_needs_two)
def imp_reprune_cia(ctx):
    """IMP-RePrune with CIA (Yin et al. 2022a): the same m IMP runs superposed one at a time as a moving average,
    re-pruned after each (:mod:`hf_sms.soup.superpose`)."""
    return _imp_reprune(ctx, "imp_reprune_cia")


@BASELINES.register("imp_reprune_caa", check=_needs_two)
def imp_reprune_caa(ctx):
    """IMP-RePrune with CAA (Yin et al. 2022a): the same m IMP runs superposed one at a time as a cumulative mean,
    re-pruned after each (:mod:`hf_sms.soup.superpose`)."""
    return _imp_reprune(ctx, "imp_reprune_caa")

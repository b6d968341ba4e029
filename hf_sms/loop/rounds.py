"""Phases run together: the training jobs of one or more phases placed on the process groups at once, then each phase
scored and souped (Algorithm 1's body, docs/method.md §1; docs/parallel.md).

A *track* is a generator that yields its next :class:`~hf_sms.training.phase.PhaseSpec` and receives its
:class:`~hf_sms.training.phase.PhaseResult`: an SMS trajectory (one per soup method), an IMP baseline. :func:`drive`
runs a run's tracks. On one process group each track runs to its end in turn (Algorithm 1, then each baseline, as on
one process). On several, the next phase of every track forms a round (:func:`run_round`): its jobs, one per replica
or IMP track, go to the groups longest first (:func:`hf_sms.loop.schedule.place`), a group that is done waits for the
others, and then every phase is scored and souped by all processes together, in track order. A lone track with no
soup (IMP, IMP_mx) yields one :class:`~hf_sms.training.phase.TrackJob` of all its phases instead: its group trains
and measures them while the other groups go through the rounds. A job writes its own checkpoint folder and depends
only on its phase's start, so any placement trains the same models, and a killed run resumes whatever jobs had
finished.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable

from torch import nn

from ..adapters.replica import kind_of, make_replica, replica_distances, trained_state
from ..adapters.soup import build_subset_soup, subset_soup, subset_weights
from ..checkpoint.constants import REPLICA_STATE, SPARSITY_NAME
from ..pruning.masks import PruningStep, WeightZeros
from ..seeding import derive_seed
from ..soup.method import SoupMethod, indicator_weights
from ..soup.soup import soup
from ..training.phase import PhaseResult, PhaseSpec, TrackJob
from .replica_training import Parked, check_finite, load_replica, park, release_memory
from .schedule import job_steps, place

logger = logging.getLogger("hf_sms")


def drive(ctx, tracks: dict) -> dict:
    """Run every track to its end; ``{name: what the track returned}``."""
    if ctx.world.n_groups == 1:  # nothing to run beside: each track in turn, each phase on its own
        return {name: _drive(ctx, {name: track})[name] for name, track in tracks.items()}
    return _drive(ctx, tracks)


def _drive(ctx, tracks: dict) -> dict:
    done, pending = {}, {}
    for name, track in tracks.items():
        _advance(name, track, None, pending, done)
    while pending:
        names = list(pending)
        specs = [pending[name] for name in names]
        results = [ctx.run_phase(specs[0])] if len(specs) == 1 else ctx.run_round(specs)
        for name, result in zip(names, results):
            with ctx.world.assigned(result.owners):  # the track records its phase where the replicas were
                _advance(name, tracks[name], result, pending, done)
    return done


def _advance(name, track, result, pending: dict, done: dict) -> None:
    try:
        pending[name] = track.send(result)  # send(None) starts the track
    except StopIteration as stop:
        pending.pop(name, None)
        done[name] = stop.value


def run_round(ctx, specs: list[PhaseSpec]) -> list[PhaseResult]:
    """Prune every phase (Step 1), train every job on its group (Step 2), then score and soup each phase (Step 3).

    A replica folder two phases share (every trajectory's first phase) is one job, trained once. A phase's
    ``seconds`` is the round's pruning and training plus its own scoring and soup.
    """
    start, world = time.perf_counter(), ctx.world
    jobs: dict[str, tuple[int, int]] = {}  # replica folder -> (phase, replica): the round's jobs
    for s, spec in enumerate(specs):
        for i in range(_replicas(spec)):
            jobs.setdefault(spec.replica_folder(i), (s, i))
    n_train = _length(ctx.train_dataset)
    costs = {folder: _cost(specs[s], i, n_train) for folder, (s, i) in jobs.items()}
    share = ctx.args.share_idle_groups and all(_splits(h, world) for spec in specs for h in spec.hparams)
    placed, planned = (dict(zip(jobs, x)) for x in place(list(costs.values()), world.n_groups, share))
    world.join(list(placed.values()))
    # a replica belongs to the first group that trains it: that group keeps it for the soup
    owners = [[placed[spec.replica_folder(i)][0] for i in range(_replicas(spec))] for spec in specs]
    mine = [f for f in jobs if world.group_index in placed[f]]
    pruned = []
    for spec, groups in zip(specs, owners):  # in phase order on every process: mask broadcasts pair up
        held = [i for i in range(_replicas(spec)) if spec.replica_folder(i) in mine]
        with world.assigned(groups):
            pruned.append(None if isinstance(spec, TrackJob) else _prune(ctx, spec, held))
    release_memory()  # the pruning's scores and work buffers, back to the system before the replicas train
    trained, records = {}, []
    order = sorted(mine, key=lambda f: (planned[f], -costs[f]))  # every group in the planned order
    for k, folder in enumerate(order):
        s, i = jobs[folder]
        spec = specs[s]
        resumed = any(os.path.isfile(os.path.join(ctx.run_dir.path(folder), f)) for f in (SPARSITY_NAME, REPLICA_STATE))
        t0 = ctx.clock()
        with world.joined(placed[folder]):  # several groups: they start together
            if len(placed[folder]) > 1:
                records.append(_record("wait", t0, ctx))
            if world.is_group_main and world.n_groups > 1:
                logger.info("[hf-sms] group(s) %s start %s (%g steps)", placed[folder], folder, costs[folder])
            t0 = ctx.clock()
            if isinstance(spec, TrackJob):  # every phase of the track, its rows measured by this group
                model = spec.run()
            else:
                starts, steps, _ = pruned[s]
                model = ctx.train_replica(
                    starts[i],
                    steps[i],
                    spec.hparams[i],
                    folder,
                    check_mask=spec.exact_masks,
                    keep_adapters=spec.shared and spec.soup is not None,
                    **spec.trainer_kwargs(i),
                )
                if _parks(ctx, spec, i, placed[folder], later=order[k + 1 :]):
                    del model  # its folder holds it, bit for bit: on disk while the next replica trains
                    model = park(starts[i], ctx.run_dir.path(folder))
                else:
                    model = ctx.recalibrate(model, world.group)  # the processes holding replica i share the pass
        if placed[folder][0] == world.group_index:
            trained[folder] = model
        records.append(
            _record("train", t0, ctx, job=folder, steps=costs[folder], resumed=resumed, groups=placed[folder])
        )
    t0 = ctx.clock()
    world.wait()  # a group that is done waits for the others, however long they train
    records.append(_record("wait", t0, ctx))
    ctx.recorder.jobs(records)
    for folder, model in trained.items():  # back in memory for the soup, one at a time
        if isinstance(model, Parked):
            trained[folder] = ctx.recalibrate(load_replica(model.start, model.folder), world.group)
    trained_s, results, writes = time.perf_counter() - start, [], []
    for s, spec in enumerate(specs):
        t0, write = time.perf_counter(), None
        with world.assigned(owners[s]):
            if isinstance(spec, TrackJob):  # its rows, from the group that measured them
                rows = world.object_from_owner({0: trained[spec.folder]} if spec.folder in trained else {}, 0)
                result = PhaseResult(None, {}, [], [], None, rows=rows)
            else:
                candidates = {i: trained[spec.replica_folder(i)] for i in world.owned(len(spec.hparams))}
                result, write = _soup(ctx, spec, pruned[s][2], candidates)
                del candidates  # a subset phase's result keeps none: they share the start its soup is written into
        result.owners, result.seconds = owners[s], trained_s + time.perf_counter() - t0
        results.append(result)
        writes.append(write)
    trained.clear()  # the replicas are scored: a subset soup is written into the start they share
    for s, write in enumerate(writes):
        if write is not None:
            t0 = time.perf_counter()
            with world.assigned(owners[s]):
                results[s].soup = write()
            results[s].seconds += time.perf_counter() - t0
    for spec, result in zip(specs, results):  # a run never goes on from, or ends on, a non-finite soup
        if isinstance(result.soup, nn.Module):
            check_finite(result.soup.named_parameters(), f"the soup of {spec.folder}", "lower learning_rate")
    return results


def _prune(ctx, spec: PhaseSpec, held: list[int]) -> tuple[dict, dict, PruningStep | dict]:
    """``({replica: start}, {replica: pruning step}, the phase's step)`` for the replicas of ``spec`` this process
    trains (``held``); the phase's step is ``{replica: step}`` of those it owns for independent tracks."""
    plan, example = ctx.args.plan, ctx.example
    if spec.shared:  # one mask for every replica, broadcast from rank 0
        step = (
            plan.prune(spec.start, spec.sparsity, spec.masks, example, sync=ctx.world.broadcast_masks)
            if spec.prune
            else PruningStep.measure(spec.start, spec.masks or {})
        )
        if not kind_of(ctx.args).full:  # frozen weights keep their zeros: those are the masks, no bool tensor held
            step.masks = WeightZeros(spec.start, step.masks)
        return dict.fromkeys(held, spec.start), dict.fromkeys(held, step), step
    masks = spec.masks or {}  # independent tracks: each prunes its own model, no broadcast
    steps = {i: plan.prune(spec.start[i], spec.sparsity, masks.get(i), example) for i in held}
    return spec.start, steps, {i: steps[i] for i in ctx.world.owned(len(spec.hparams))}


def _soup(ctx, spec: PhaseSpec, step, candidates: dict) -> tuple[PhaseResult, Callable[[], nn.Module] | None]:
    """Score the candidates on validation and merge them (Step 3); with subset replicas, also what writes their soup
    (:func:`_subset_soup`)."""
    plan, example, world = ctx.args.plan, ctx.example, ctx.world
    val = ctx.gather_metric(candidates, ctx.eval_dataset)
    if spec.soup is not None and spec.shared and not kind_of(ctx.args).full:  # souped from the trained subsets
        return _subset_soup(ctx, spec, step, candidates, val)
    result, kept = None, []
    pairs = None
    if spec.soup is not None and spec.shared:
        pairs = _pair_soups(
            ctx, spec, lambda pair: soup(candidates, pair, template=spec.start, world=world, scores=val)
        )

    def make(method: str):
        return soup(
            candidates,
            method,
            template=spec.start if spec.shared else next(iter(spec.start.values())),  # on the run's device
            world=world,
            scores=val,
            evaluate=lambda m: ctx.recorder.evaluate(m, ctx.eval_dataset, shared=True),
            recalibrate=ctx.recalibrate,
            config=ctx.args,
            sparsity=spec.sparsity,
            reprune=lambda model, sparsity: plan.masks(model, sparsity, example_inputs=example),
            base=spec.start if spec.shared else None,  # the pruned start every replica retrained from
            options=ctx.args.soup_options.get(method),
            seed=derive_seed(ctx.args.seed, "soup", spec.folder),
            fit=ctx.fit_data,  # the learned soup's held-out share of validation
        )

    if spec.soup is not None:
        result, weights = make(spec.soup)
        kept = [i for i, w in enumerate(weights) if w]
    also = {method: make(method)[0] for method in spec.also}
    return PhaseResult(result, candidates, val, kept, step, pair_soups=pairs, also=also), None


def _subset_soup(ctx, spec: PhaseSpec, step, candidates: dict, val: list) -> tuple[PhaseResult, Callable]:
    """The phase's result for replicas that trained a subset of its start, and what writes their soup into the
    start in place (no new weights: the peak of such a phase is its start, not start and soup). The replicas share
    the start's weights, so everything that scores them or needs the start as it was comes first: the soup's
    weights (trial soups of adapters in adapter form), distances, pair soups, the candidates' test scores and
    diversity; the writes wait until every phase of the round is scored (a later phase's replicas may have trained
    from this start)."""
    n, template = len(spec.hparams), make_replica(spec.start, ctx.args)  # shapes and layers, built once
    every = ctx.world.all_candidates({i: trained_state(c) for i, c in candidates.items()}, n, trained_state(template))
    states = [every[i] for i in range(n)]

    def evaluate(model):
        return ctx.recorder.evaluate(model, ctx.eval_dataset, shared=True)

    weights = subset_weights(spec.start, states, spec.soup, ctx.args, val, evaluate, ctx.recalibrate, template)
    pairwise = replica_distances(spec.start, states, ctx.args, template)
    pairs = _pair_soups(ctx, spec, lambda pair: subset_soup(spec.start, states, pair, ctx.args, val, template=template))
    scored = ctx.recorder.candidate_scores(candidates, val)
    kept = [i for i, w in enumerate(weights) if w]
    result = PhaseResult(None, {}, val, kept, step, pairwise_l2=pairwise, pair_soups=pairs, scored=scored)
    return result, lambda: build_subset_soup(spec.start, states, weights, ctx.args, ctx.recalibrate, template, True)


def _pair_soups(ctx, spec: PhaseSpec, make) -> list[dict] | None:
    """With ``pairwise_soups``: the uniform soup of every pair of the phase's n replicas (``make(method) -> (soup,
    weights)``), BatchNorm recalibrated, scored on validation and every test set: the paper's scatter of each pair's
    soup against the better of its two ingredients (its OOD scatter on the corrupted sets). Every process builds and
    scores each pair together, once per phase folder (the trajectories share their first phase's replicas)."""
    if not (ctx.args.pairwise_soups and spec.diagnosed):
        return None
    if spec.folder in ctx.pair_soups:
        return ctx.pair_soups[spec.folder]
    n, out = len(spec.hparams), []
    for pair in itertools.combinations(range(n), 2):
        select = SoupMethod(lambda scores, trial, config, pair=pair: indicator_weights(pair, n))
        model = ctx.recalibrate(make(select)[0])
        val = ctx.recorder.evaluate(model, ctx.eval_dataset, shared=True)
        scores = ctx.recorder.test_scores(model, shared=True)
        out.append({"pair": list(pair), "val": val, "test": scores["test"], "tests": scores["tests"]})
    ctx.pair_soups[spec.folder] = out
    return out


def _parks(ctx, spec, i: int, groups: list[int], later: list[str]) -> bool:
    """Whether a full replica this process just trained waits for its soup on disk instead of in memory: it does
    when this process trains another job after it (the soup would otherwise hold every finished replica beside the
    one in training) and wrote the folder itself (a group of one)."""
    full = not isinstance(spec, TrackJob) and kind_of(spec.hparams[i]).full
    return full and bool(later) and len(groups) == 1 and ctx.world.group_size == 1


def _record(kind: str, t0: float, ctx, **extra) -> dict:
    w = ctx.world
    return {
        "kind": kind,
        "rank": w.rank,
        "group": w.group_index,
        "start": round(t0, 3),
        "end": round(ctx.clock(), 3),
        **extra,
    }


def _replicas(spec) -> int:
    return 1 if isinstance(spec, TrackJob) else len(spec.hparams)


def _cost(spec, i: int, n_train: int) -> float:
    if isinstance(spec, TrackJob):
        return sum(job_steps(h, n_train) for h in spec.hparams)
    return job_steps(spec.hparams[i], n_train)


def _splits(args, world) -> bool:
    """A job can be data-parallel over every group: the global batch divides over all processes."""
    return args.per_device_train_batch_size % world.size == 0


def _length(dataset) -> int:
    try:
        return len(dataset)
    except TypeError:  # a stream: its jobs are sized by max_steps, which a stream requires
        return 1

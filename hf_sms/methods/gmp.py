"""GMP, gradual magnitude pruning (Zhu & Gupta 2017, "To prune, or not to prune"), with and without SMS
(the paper's §4.3; docs/method.md §7): ``n`` pruning steps at uniformly distributed iterations of one training
run, the sparsity following a cubic schedule; masks only grow.

This file is the whole method: the schedule (pure functions of the iteration, shared with DPF), the trainer
callback that prunes, the run with SMS between pruning steps, and its registration with its config check.
It follows the original LR schedule (``SparseSoupTrainer(..., lr_schedule="original")``) and starts dense
(``masks={}``). With ``num_replicas = m > 1`` every phase (the interval between two pruning steps) that starts
at or after ``sms_start_epoch`` trains m copies of the just-pruned model with independent random streams and
merges them (``merge_methods[0]``, BatchNorm recalibrated) before the next pruning step; each copy starts with
fresh optimizer state, since the m copies' momenta are not merged. Earlier phases, and every phase when m = 1,
are the plain method in one uninterrupted run.
"""

from __future__ import annotations

import copy

import torch
from transformers import TrainerCallback

from ..plan import PruningPlan, resolve_pruning
from ..pruning.masks import apply_masks, masks_from_model
from ..registry import PRUNING_METHODS
from ..seeding import derive_seed
from ..training.phase import PhaseSpec, phase_folder
from .common import check_pruning_steps, single, sms_start_step, total_steps


def _check_schedule(n: int, target: float) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of pruning steps must be an integer >= 1, got {n!r}")
    if not (isinstance(target, (int, float)) and 0.0 <= target < 1.0):
        raise ValueError(f"target sparsity must be a fraction in [0, 1), got {target!r}")


def gmp_sparsity(k: int, n: int, target: float) -> float:
    """Sparsity after pruning step ``k`` of ``n`` (0 <= k <= n): ``target * (1 - (1 - k/n) ** 3)``.

    Zhu & Gupta 2017's cubic schedule: large steps early, while many redundant weights remain, small ones
    at the end. ``gmp_sparsity(0, n, S) == 0`` and ``gmp_sparsity(n, n, S) == S`` exactly.
    """
    _check_schedule(n, target)
    if not (isinstance(k, int) and 0 <= k <= n):
        raise ValueError(f"pruning step k must be an integer in [0, {n}], got {k!r}")
    return float(target) * (1.0 - (1.0 - k / n) ** 3)


def pruning_iterations(total_steps: int, n: int) -> list[int]:
    """The iterations after which GMP prunes: ``round(k * total_steps / (n + 1))`` for k = 1..n.

    The paper only says "prune at uniformly distributed timesteps". We split training into ``n + 1`` equal
    intervals: dense training first, then one interval after each pruning step, so the last step also gets
    a full interval to recover in (pruning at the very end would leave the last step untrained). Iteration
    t means "after t optimizer steps". With ``total_steps >= n + 1`` the iterations are strictly increasing
    and lie in ``[1, total_steps - 1]``. (``round`` is Python's, ties to even.)
    """
    _check_schedule(n, 0.0)
    if not isinstance(total_steps, int) or total_steps < n + 1:
        raise ValueError(f"{n} pruning steps need total_steps >= {n + 1} (one interval each), got {total_steps!r}")
    return [round(k * total_steps / (n + 1)) for k in range(1, n + 1)]


def pruning_targets(total_steps: int, n: int, target: float) -> dict[int, float]:
    """``{iteration: sparsity}`` of GMP's pruning steps (:func:`pruning_iterations`, :func:`gmp_sparsity`)."""
    _check_schedule(n, target)
    return {t: gmp_sparsity(k, n, target) for k, t in enumerate(pruning_iterations(total_steps, n), start=1)}


def sparsity_at(iteration: int, total_steps: int, n: int, target: float) -> float:
    """GMP's sparsity at ``iteration``: that of the last pruning step at or before it (0 before the first).

    DPF (Lin et al. 2020) recomputes its mask at this target.
    """
    reached = [s for t, s in pruning_targets(total_steps, n, target).items() if t <= iteration]
    return reached[-1] if reached else 0.0


def gmp_phases(total_steps: int, n: int, target: float) -> list[tuple[int, int, float]]:
    """GMP+SMS's phases: ``(start_iteration, end_iteration, sparsity to prune to at start)``, n + 1 of them.

    The phases tile ``[0, total_steps]``: the first trains dense (sparsity 0.0: nothing to prune), each
    later one starts at a pruning step (Zhu & Gupta 2017's schedule). A phase trains ``end - start`` steps
    (``max_steps``) with ``SparseSoupTrainer(..., lr_schedule="original", step_offset=start,
    total_steps=total_steps)``, so its learning rates are those of the single run; the soup is merged
    before the next pruning step (docs/method.md §7). ``gmp_phases(8, 3, 0.9)`` is
    ``[(0, 2, 0.0), (2, 4, 0.6333), (4, 6, 0.8667), (6, 8, 0.9)]`` (rounded).
    """
    targets = pruning_targets(total_steps, n, target)
    starts = [0, *targets]
    ends = [*targets, total_steps]
    return [(a, b, targets.get(a, 0.0)) for a, b in zip(starts, ends)]


class GradualPruning(TrainerCallback):
    """GMP (Zhu & Gupta 2017) in one :class:`~hf_sms.SparseSoupTrainer` run.

    At each iteration of :func:`pruning_targets` the model is magnitude-pruned to the cubic schedule's
    sparsity with ``allocation`` (masks only grow), the pruned weights and their optimizer state (momentum,
    Adam's moments) are zeroed, and the trainer keeps the new masks exact from then on::

        trainer = SparseSoupTrainer(model, args, masks={}, lr_schedule="original",
                                    callbacks=[GradualPruning(n_steps=4, target=0.9)])

    Iterations are global: ``trainer.step_offset + state.global_step`` in a run of ``trainer.total_steps``
    (default: this trainer's ``max_steps``). A trainer covering iterations ``(a, b]`` prunes at ``a`` when
    training begins and at the pruning iterations in ``(a, b)``; the one at ``b`` belongs to the next
    phase's start, so training split into consecutive phases prunes exactly as one run would.

    Args:
        n_steps: number of pruning steps n.
        target: final sparsity S in [0, 1).
        allocation, structure, criterion, seed: what each step prunes (see :func:`hf_sms.compute_masks`); the
            paper's global magnitude pruning by default. ``plan``: a resolved :class:`hf_sms.plan.PruningPlan`
            instead (a run's ``args.plan``).
        example_inputs: a batch that orders layers by call (for ``uniform_plus``; see ``compute_masks``).
    """

    def __init__(
        self,
        n_steps: int,
        target: float,
        allocation: str | None = None,
        example_inputs=None,
        *,
        structure: str | None = None,
        criterion: str | None = None,
        seed: int = 0,
        plan: PruningPlan | None = None,
    ):
        _check_schedule(n_steps, target)
        self.plan = plan or resolve_pruning(allocation, structure, criterion, seed)  # raises on a bad name, now
        self.n_steps, self.target = n_steps, float(target)
        self.example_inputs = example_inputs
        self.trainer = None  # the SparseSoupTrainer, bound when it trains

    def bind_trainer(self, trainer) -> None:
        """Called by ``SparseSoupTrainer.train``: the callback prunes through the trainer's masks."""
        self.trainer = trainer

    def _window(self, state) -> tuple[int, int]:
        if self.trainer is None:
            raise RuntimeError(f"{type(self).__name__} works with SparseSoupTrainer, which binds it in train()")
        offset = self.trainer.step_offset
        total = self.trainer.total_steps or offset + state.max_steps
        if offset + state.max_steps > total:
            raise ValueError(f"iterations {offset}+{state.max_steps} run past total_steps={total}")
        return offset, total

    def _sparsity_to_prune(self, iteration: int, total: int) -> float | None:
        return pruning_targets(total, self.n_steps, self.target).get(iteration)

    def _prune(self, sparsity: float, optimizer) -> None:
        trainer = self.trainer
        masks = self.plan.masks(trainer.model, sparsity, trainer.masks or None, self.example_inputs)
        trainer.set_masks(masks, optimizer)

    def _maybe_prune(self, state, optimizer) -> None:
        offset, total = self._window(state)
        sparsity = self._sparsity_to_prune(offset + state.global_step, total)
        if sparsity is not None:
            self._prune(sparsity, optimizer)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        offset, total = self._window(state)
        allowed = sparsity_at(offset + state.global_step, total, self.n_steps, self.target)
        masks = self.trainer.masks
        numel = sum(m.numel() for m in masks.values())
        pruned = numel - sum(int(torch.count_nonzero(m)) for m in masks.values())
        slack = self.plan.rounding(self.trainer.model, masks, self.example_inputs)
        if pruned > round(allowed * numel) + slack:
            raise ValueError(
                f"the trainer starts at sparsity {pruned / numel:.4f} but the schedule is at {allowed:.4f} here; "
                "start dense with SparseSoupTrainer(..., masks={}) (masks=None prunes to args.target_sparsity)"
            )
        self._maybe_prune(state, optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step < state.max_steps:  # the last iteration's pruning belongs to the next phase
            self._maybe_prune(state, optimizer)


def gradual(ctx, plain_kwargs, copy_kwargs, soup: str, dense_phases: bool = False):
    """Prune during one training run on GMP's schedule, +SMS per interval, through the loop's phase step.

    Args:
        ctx: the loop (:class:`~hf_sms.methods.common.MethodContext`).
        plain_kwargs: ``fn(continues) -> dict``: trainer arguments of the plain run (its pruning callback, a masking
            policy); ``continues`` says SMS phases follow it.
        copy_kwargs: ``fn() -> dict``: trainer arguments of each SMS copy.
        soup: the soup method that merges the copies.
        dense_phases: DPF: the copies keep their dense weights, the soup is their plain mean, and each phase's mask
            is computed from it without zeroing, so pruned values persist and may come back, as in plain DPF; the
            soup a phase records (and the run returns) is that mean masked to the phase's sparsity. Otherwise
            (GMP) every phase prunes its start and masks only grow.
    """
    a, name, world = ctx.args, ctx.args.pruning_method, ctx.world
    total = total_steps(ctx)
    phases = gmp_phases(total, a.pruning_steps, a.target_sparsity)
    start = sms_start_step(ctx, total)
    sms = [p for p in phases[1:] if p[0] >= start] if a.num_replicas > 1 else []
    split = sms[0][0] if sms else total  # the plain method runs uninterrupted up to here
    ctx.set_phases([s for _, _, s in sms] or [a.target_sparsity])
    plain = single(a, max_steps=split, seed=derive_seed(a.seed, name, 0, 0))
    model = ctx.train_single(ctx.pretrained, plain, f"{name}/plain", total_steps=total, **plain_kwargs(bool(sms)))
    if not sms:
        model = ctx.recalibrate(model)  # as every soup is, so that comparisons are fair (docs/method.md §5)
        ctx.recorder.row(name, len(ctx.phases) - 1, ctx.recorder.measure(model, timed=True, shared=True))
        return model
    masks, result = (None if dense_phases else masks_from_model(model)), None
    for p, (begin, end, sparsity) in enumerate(sms):
        if dense_phases:  # the phase's mask from the dense weights, not applied: they keep their values
            masks = world.broadcast_masks(a.plan.masks(model, sparsity, example_inputs=ctx.example))
        spec = PhaseSpec(
            sparsity=sparsity,
            start=model,
            masks=masks,
            hparams=[
                single(a, max_steps=end - begin, seed=derive_seed(a.seed, name, p + 1, i))
                for i in range(a.num_replicas)
            ],
            folder=phase_folder(f"{name}-sms", p),
            soup=soup,
            prune=not dense_phases,
            exact_masks=not dense_phases,
            trainer_kwargs=lambda i, begin=begin: {
                "lr_schedule": "original",
                "step_offset": begin,
                "total_steps": total,
                **copy_kwargs(),
            },
        )
        result = ctx.run_phase(spec)
        model = result.soup
        if dense_phases:  # what the phase gives is its mean under the phase's mask (DPF is judged sparse)
            sparse = copy.deepcopy(model)
            masks = a.plan.masks(sparse, sparsity, example_inputs=ctx.example)
            apply_masks(sparse, world.broadcast_masks(masks))
            result.soup = ctx.recalibrate(sparse)
        else:
            masks = result.masks
        # DPF's copies are dense: their rows would pair dense scores with the soup's sparsity (only the soup's kept)
        ctx.recorder.sms(a.merge_methods[0], p, sparsity, result, candidates=not dense_phases)
    return result.soup


def gmp(ctx):
    """GMP: the plain run prunes with :class:`GradualPruning`; the copies train under the phase's mask."""
    a = ctx.args
    callback = GradualPruning(a.pruning_steps, a.target_sparsity, example_inputs=ctx.example, plan=a.plan)
    return gradual(ctx, lambda continues: {"callbacks": [callback]}, dict, a.merge_methods[0])


def preflight(ctx) -> None:
    """The schedule fits the budget (a pruning step needs an interval): checked before the run folder is made."""
    gmp_phases(total_steps(ctx), ctx.args.pruning_steps, ctx.args.target_sparsity)


PRUNING_METHODS.add(
    "gmp",
    gmp,
    check=check_pruning_steps,
    preflight=preflight,
    during_training=True,
    tiny={"max_steps": 8, "pruning_steps": 2},
)

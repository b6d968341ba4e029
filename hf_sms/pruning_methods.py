"""Pruning during training with and without SMS: GMP, DPF, BIMP (the paper's §4.3; docs/method.md §7).

Each method is ``fn(runner) -> final model`` in ``PRUNING_METHODS``; :meth:`SparseModelSoup.run` calls it
when ``pruning_method != "imp"``. ``num_train_epochs`` is then the whole training budget E, from the given
(typically freshly initialised) model, following the original LR schedule (``lr_scheduler_type``).

With ``num_replicas = m > 1`` every phase that starts at or after ``sms_start_epoch`` is an SMS phase: m
copies of the just-pruned model train with independent random streams and are merged (``merge_methods[0]``,
BatchNorm recalibrated) before the next pruning step. Phases before it, and every phase when m = 1, are
the plain method in one uninterrupted run. For GMP and DPF a phase is the interval between two pruning
steps (:func:`hf_sms.during_training.gmp_phases`); each copy starts with fresh optimizer state, since the m
copies' momenta are not merged. For BIMP a phase is one of its ``n_phases`` IMP cycles.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from torch import nn

from .during_training import DynamicPruning, GradualPruning, gmp_phases
from .pruning import PruningStep, apply_masks, compute_masks, masks_from_model, prune
from .registry import registrar
from .seeding import derive_seed

PRUNING_METHODS: dict[str, Callable] = {}
register_pruning_method = registrar(PRUNING_METHODS, "pruning method")


def total_steps(runner) -> int:
    """Optimizer steps in the budget: ``max_steps``, else ``num_train_epochs`` of this replica's shard."""
    a = runner.args
    if a.max_steps > 0:
        return a.max_steps
    batches = math.ceil(len(runner.train_dataset) / (a.per_device_train_batch_size * runner.world.group_size))
    return round(a.num_train_epochs * math.ceil(batches / a.gradient_accumulation_steps))


@register_pruning_method("gmp")
def gmp(runner) -> nn.Module:
    """GMP (Zhu & Gupta 2017): prune on the cubic schedule during one training run; +SMS per interval."""
    return _gradual(runner, feedback=False)


@register_pruning_method("dpf")
def dpf(runner) -> nn.Module:
    """DPF (Lin et al. 2020): GMP's schedule with dense weights and error feedback; +SMS per interval."""
    return _gradual(runner, feedback=True)


def _gradual(runner, feedback: bool) -> nn.Module:
    a, name = runner.args, runner.args.pruning_method
    total = total_steps(runner)
    phases = gmp_phases(total, a.pruning_steps, a.target_sparsity)
    start = _sms_start_step(runner, total)
    sms = [p for p in phases[1:] if p[0] >= start] if a.num_replicas > 1 else []
    split = sms[0][0] if sms else total  # the plain method runs uninterrupted up to here
    runner.results["phases"] = [s for _, _, s in sms] or [a.target_sparsity]
    callback_type = DynamicPruning if feedback else GradualPruning
    kwargs = {"interval": a.dpf_interval} if feedback else {}
    callback = callback_type(a.pruning_steps, a.target_sparsity, a.allocation, example_inputs=runner.example, **kwargs)
    plain = _single(a, max_steps=split, seed=derive_seed(a.seed, name, 0, 0))
    model = runner.train_single(runner.pretrained, plain, f"{name}/plain", callbacks=[callback], total_steps=total)
    if not sms:
        model = runner.recalibrate(model)  # as every soup is, so that comparisons are fair (docs/method.md §5)
        runner.record(name, len(runner.results["phases"]) - 1, model)
        return model
    masks = None if feedback else masks_from_model(model)
    for p, (begin, end, sparsity) in enumerate(sms):
        runner.phase_start = time.perf_counter()
        step = prune(model, sparsity, a.allocation, masks, runner.world.broadcast_masks, runner.example)
        masks = step.masks
        copies = {}
        for i in runner.world.owned(a.num_replicas):
            h = _single(a, max_steps=end - begin, seed=derive_seed(a.seed, name, p + 1, i))
            extra = {"callbacks": [callback_type(a.pruning_steps, a.target_sparsity, a.allocation, **kwargs)]}
            copies[i] = runner.recalibrate(
                runner.train_replica(
                    model,
                    step,
                    h,
                    f"{name}-sms/phase{p + 1}/replica{i}",
                    lr_schedule="original",
                    step_offset=begin,
                    total_steps=total,
                    **(extra if feedback else {}),
                )
            )
        model = _merge(runner, model, copies, sparsity, p, feedback)
    return model


def _merge(runner, template: nn.Module, copies: dict, sparsity: float, p: int, feedback: bool) -> nn.Module:
    """The soup of a phase's copies. DPF's copies recompute their masks from their own dense weights, so their
    masks differ: their average is re-pruned to the phase's sparsity (as IMP-RePrune does)."""
    a = runner.args
    val = runner.gather_metric(copies, runner.eval_dataset)
    if not feedback:
        soup, kept = runner.merge(a.merge_methods[0], template, copies, val)
    else:
        weights = [1 / a.num_replicas] * a.num_replicas
        state = runner.world.average(runner.state_dicts(copies), weights, template.state_dict())
        soup, kept = runner.load(template, state), list(range(a.num_replicas))
        apply_masks(soup, runner.world.broadcast_masks(compute_masks(soup, sparsity, a.allocation)))
        soup = runner.recalibrate(soup)
    runner.record_sms(a.merge_methods[0], p, sparsity, copies, val, soup, kept)
    return soup


@register_pruning_method("bimp")
def bimp(runner) -> nn.Module:
    """BIMP (Zimmer et al. 2021): one budget of E epochs, dense pretraining for ``bimp_pretrain_epochs``, then
    ``n_phases`` equal IMP cycles with the retraining schedule (LLR/ALLR) inside the same budget; +SMS per
    cycle from ``sms_start_epoch`` on. The cycles are the SMS loop itself, in ``output_dir/bimp``."""
    from .sms import SparseModelSoup

    a = runner.args
    pre = _single(a, num_train_epochs=a.bimp_pretrain_epochs, seed=derive_seed(a.seed, "bimp", 0, 0))
    dense = runner.train_single(runner.pretrained, pre, "bimp-pretrain")
    cycle = (a.num_train_epochs - a.bimp_pretrain_epochs) / a.n_phases
    start = a.sms_start_epoch or 0.0
    per_phase = [a.num_replicas if a.bimp_pretrain_epochs + p * cycle >= start else 1 for p in range(a.n_phases)]
    cycles = dataclasses.replace(
        a,
        output_dir=runner.run_dir.path("bimp"),
        pruning_method="imp",
        sms_start_epoch=None,
        num_train_epochs=cycle,
        pretrain_epochs=a.bimp_pretrain_epochs,
        pretrain_learning_rate=a.learning_rate,
        replicas_per_phase=per_phase,
        merge_methods=a.merge_methods[:1],
        push_to_hub=False,
    )
    inner = SparseModelSoup(
        dense, cycles, runner.train_dataset, runner.metric_fn, runner.eval_dataset, runner.tests, **runner.kwargs
    )
    inner.run()
    runner.results.update({k: inner.results[k] for k in ("phases", "rows", "sms")})
    return inner.final_soup


def _single(args, **fields):
    """The config of one run inside a method: the original LR schedule, no nested method or SMS fields."""
    fixed = {"pruning_method": "imp", "sms_start_epoch": None, "lr_schedule": "original", "retrain_schedule": "llr"}
    return dataclasses.replace(args, **fixed, **fields)


def _sms_start_step(runner, total: int) -> int:
    a = runner.args
    return 0 if not a.sms_start_epoch else round(a.sms_start_epoch / a.num_train_epochs * total)


def empty_step() -> PruningStep:
    """No pruning: the dense start of a run that prunes during training."""
    return PruningStep({}, 0.0, 0.0)

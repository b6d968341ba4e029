"""What the pruning-during-training methods share: the budget in steps, the config of one run inside a method,
and the checks every such method makes of a run's config before any work.

A method is ``fn(ctx) -> final model`` in :data:`hf_sms.registry.PRUNING_METHODS`; ``ctx`` is the running
:class:`hf_sms.loop.sms.SparseModelSoup`, used through the small surface of :class:`MethodContext`.
``num_train_epochs`` is then the whole training budget E from the given (typically freshly initialised) model,
following the original LR schedule (``lr_scheduler_type``).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from torch import nn

from ..pruning.masks import PruningStep
from ..training.schedules import steps_per_epoch


class MethodContext(Protocol):
    """What a pruning method or baseline uses of the loop: the run's inputs, one phase step, one-run training,
    recalibration and recording. (:class:`hf_sms.loop.sms.SparseModelSoup` provides it; the contract tests run
    every method and baseline with the loop narrowed to these members.)"""

    args: object  # the run's SparseSoupConfig
    world: object  # the ReplicaWorld: who trains what, gathers
    phases: list  # the plan: sparsity after each phase
    results: dict  # what the run records: phases, rows, sms diagnostics
    recorder: object  # the Recorder: measure(model), row(method, phase, measured), sms(method, p, sparsity, result)
    run_dir: object  # the RunDirectory: path(name)
    pretrained: nn.Module
    train_dataset: object
    eval_dataset: object
    example: object  # one validation batch

    def copy_pretrained(self) -> nn.Module: ...  # on the device the run trains on

    def run_phase(self, spec) -> object: ...  # a PhaseSpec -> PhaseResult (hf_sms.training.phase)

    def train_single(self, start: nn.Module, args, name: str, callbacks=(), total_steps=None, **trainer_kwargs): ...

    def train_replica(self, start: nn.Module, step, args, name: str, callbacks=(), check_mask=True, **kwargs): ...

    def set_phases(self, sparsities: list) -> None: ...  # a method that prunes during training sets its own plan

    def recalibrate(self, model: nn.Module, world=None) -> nn.Module: ...  # world: who shares the pass

    def nested(self, args, model: nn.Module): ...  # a loop with other settings (BIMP's cycles)


def total_steps(ctx: MethodContext) -> int:
    """Optimizer steps in the budget: ``max_steps``, else ``num_train_epochs`` of one replica."""
    a = ctx.args
    if a.max_steps > 0:
        return a.max_steps
    # a replica's batch is per_device_train_batch_size on any number of processes (split over its group)
    per_epoch = steps_per_epoch(len(ctx.train_dataset), a.per_device_train_batch_size, 1, a.gradient_accumulation_steps)
    return round(a.num_train_epochs * per_epoch)


def single(args, **fields):
    """The config of one run inside a method: the original LR schedule, no nested method or SMS fields."""
    fixed = {"pruning_method": "imp", "sms_start_epoch": None, "lr_schedule": "original", "retrain_schedule": "llr"}
    return dataclasses.replace(args, **fixed, **fields)


def sms_start_step(ctx: MethodContext, total: int) -> int:
    a = ctx.args
    return 0 if not a.sms_start_epoch else round(a.sms_start_epoch / a.num_train_epochs * total)


def empty_step() -> PruningStep:
    """No pruning: the dense start of a run that prunes during training."""
    return PruningStep({}, 0.0, 0.0)


def check_during_training(config) -> None:
    """What every pruning-during-training method needs of a config (before any work)."""
    name = config.pruning_method
    if len(config.merge_methods) > 1:
        raise ValueError(
            f"pruning_method={name!r} runs one SMS trajectory, so it takes one soup method: "
            f"merge_methods={config.merge_methods[:1]}, not {config.merge_methods}"
        )
    if config.baselines:
        raise ValueError(
            f"baselines compare against IMP; for pruning_method={name!r} run num_replicas=1 for the plain method "
            "beside the +SMS run instead"
        )
    budget = config.num_train_epochs if config.max_steps <= 0 else None
    if config.sms_start_epoch is not None and (
        config.sms_start_epoch < 0 or (budget is not None and config.sms_start_epoch >= budget)
    ):
        raise ValueError(
            f"sms_start_epoch={config.sms_start_epoch} must lie in [0, num_train_epochs={config.num_train_epochs}); "
            "copies that start after the end never train"
        )


def check_pruning_steps(config) -> None:
    """GMP's and DPF's schedule: ``pruning_steps`` pruning iterations, and SMS phases that exist."""
    check_during_training(config)
    n = config.pruning_steps
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"pruning_steps must be an integer >= 1, got {n!r}")
    # The last pruning step is at n / (n + 1) of the run (gmp.pruning_iterations): SMS phases start at pruning
    # steps, so a later start would run no SMS at all.
    if config.num_replicas > 1 and config.sms_start_epoch:
        fraction = config.sms_start_epoch / config.num_train_epochs
        if fraction > n / (n + 1):
            last = n / (n + 1) * config.num_train_epochs
            raise ValueError(
                f"sms_start_epoch={config.sms_start_epoch} comes after the last of {n} pruning steps (at epoch "
                f"{last:g} of num_train_epochs={config.num_train_epochs}"
                + (", which max_steps rescales" if config.max_steps > 0 else "")
                + "): no phase would train copies. Set sms_start_epoch <= "
                f"{last:g}, or num_replicas=1 for the plain method"
            )

"""BIMP, budgeted IMP (Zimmer et al. 2021), with and without SMS (the paper's §4.3; docs/method.md §7): one budget of
E epochs; dense training for ``bimp_pretrain_epochs``, then ``n_phases`` equal IMP cycles with the retraining
schedule (LLR/ALLR) inside the same budget; +SMS per cycle from ``sms_start_epoch`` on. The cycles are the SMS loop
itself, run nested in ``output_dir/bimp``.
"""

from __future__ import annotations

import dataclasses

from ..registry import PRUNING_METHODS
from ..seeding import derive_seed
from .common import check_during_training, single


def bimp(ctx):
    a = ctx.args
    pre = single(a, num_train_epochs=a.bimp_pretrain_epochs, seed=derive_seed(a.seed, "bimp", 0, 0))
    dense = ctx.train_single(ctx.pretrained, pre, "bimp-pretrain")
    cycle = (a.num_train_epochs - a.bimp_pretrain_epochs) / a.n_phases
    start = a.sms_start_epoch or 0.0
    per_phase = [a.num_replicas if a.bimp_pretrain_epochs + p * cycle >= start else 1 for p in range(a.n_phases)]
    cycles = dataclasses.replace(
        a,
        output_dir=ctx.run_dir.path("bimp"),
        pruning_method="imp",
        sms_start_epoch=None,
        num_train_epochs=cycle,
        pretrain_epochs=a.bimp_pretrain_epochs,
        pretrain_learning_rate=a.learning_rate,
        replicas_per_phase=per_phase,
        merge_methods=a.merge_methods[:1],
        push_to_hub=False,
    )
    inner = ctx.nested(cycles, dense)
    inner.run()
    ctx.set_phases(inner.phases)  # the plan the nested run followed (what later baselines run on)
    ctx.results.update({k: inner.results[k] for k in ("rows", "sms")})
    return inner.final_soup


def _check(config) -> None:
    check_during_training(config)
    budget = config.num_train_epochs if config.max_steps <= 0 else None
    if budget is None:
        raise ValueError("bimp splits a budget of num_train_epochs: set max_steps=-1")
    if config.bimp_pretrain_epochs is None or not 0 < config.bimp_pretrain_epochs < budget:
        raise ValueError(
            f"bimp needs 0 < bimp_pretrain_epochs < num_train_epochs={budget} (the paper: 60 or 75 of 100), "
            f"got {config.bimp_pretrain_epochs}"
        )
    cycle = (budget - config.bimp_pretrain_epochs) / config.n_phases
    last = config.bimp_pretrain_epochs + (config.n_phases - 1) * cycle  # where the last IMP cycle starts
    if config.num_replicas > 1 and (config.sms_start_epoch or 0) > last:
        raise ValueError(
            f"sms_start_epoch={config.sms_start_epoch} comes after the start of BIMP's last cycle (epoch {last:g}): "
            f"no cycle would train copies. Set sms_start_epoch <= {last:g}, or num_replicas=1 for plain BIMP"
        )


# its dense part is the original training ALLR and LRW scale to
PRUNING_METHODS.add(
    "bimp",
    bimp,
    check=_check,
    during_training=True,
    original_length=lambda config: config.bimp_pretrain_epochs,
    tiny={"max_steps": -1, "num_train_epochs": 2, "bimp_pretrain_epochs": 1, "n_phases": 2},
)

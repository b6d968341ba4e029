"""Baselines with stochastic weight averaging (Izmailov et al. 2018): ``imp_swa``, the paper's appendix (IMP, m = 1,
whose every phase keeps the average of the weights at each epoch's end, restarted each phase, and ends on it), and
``swamp`` (Choi et al., ICLR 2024: m particles per IMP cycle, each with SWA, averaged, the average pruned for the
next cycle). Every model the loop scores is BatchNorm-recalibrated; an average of weights trained under one mask
has that mask exactly."""

from __future__ import annotations

import dataclasses

import torch
from transformers import TrainerCallback

from ..registry import BASELINES
from ..seeding import derive_seed
from ..training.phase import PhaseSpec, phase_folder
from .imp import run_imp


class EpochAverage(TrainerCallback):
    """The running mean of the trained weights at every epoch's end (float64 sums); at the end of training the model
    takes it. Only weights that train are averaged: frozen ones do not move."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.sums, self.n = None, 0

    @torch.no_grad()
    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if self.sums is None:
            self.sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in trained.items()}
        for n, p in trained.items():
            self.sums[n] += p.detach()
        self.n += 1

    @torch.no_grad()
    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.n:  # no epoch ended (nothing trained): the model as it is
            return
        for n, p in model.named_parameters():
            if n in self.sums:
                p.copy_(self.sums[n] / self.n)
        self.sums = None


@BASELINES.register("imp_swa")
def imp_swa(ctx):
    """IMP + SWA: m = 1, each phase ends on the average of its epochs' end weights (the paper's appendix)."""
    return run_imp(ctx, "imp_swa", n_tracks=1, callbacks=lambda: [EpochAverage()])


def _particles(config) -> None:
    if config.num_replicas < 2:
        raise ValueError("baselines=['swamp'] averages num_replicas SWA particles per cycle: set num_replicas >= 2")


@BASELINES.register("swamp", check=_particles)
def swamp(ctx):
    """SWAMP: each phase trains m particles from the phase's pruned start, each ending on its own SWA average, and
    continues from their uniform average (pruned at the next phase's start). Particles differ by their seed only
    (their own streams); the retraining schedule and length are the run's, as for every baseline here."""
    a, model, masks = ctx.args, ctx.copy_pretrained(), None

    def particle(i: int) -> dict:
        return {"callbacks": [EpochAverage()]}  # each particle its own average

    for p, sparsity in enumerate(ctx.phases):
        hparams = [dataclasses.replace(a, seed=derive_seed(a.seed, "swamp", p, i)) for i in range(a.phase_replicas(p))]
        folder = phase_folder("swamp", p)
        result = yield PhaseSpec(sparsity, model, masks, hparams, folder, trainer_kwargs=particle, diagnosed=False)
        model, masks = result.soup, result.masks
        ctx.recorder.row("swamp", p, ctx.recorder.measure(model, shared=True))
    return model

"""IMP + SWA, the paper's appendix baseline ``imp_swa``: IMP (m = 1) whose every phase keeps a stochastic weight
average (Izmailov et al. 2018) of the weights at each epoch's end, restarted each phase; the phase ends on the
average, BatchNorm recalibrated (as every model the loop scores). The average of weights trained under one mask has
that mask exactly."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..registry import BASELINES
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

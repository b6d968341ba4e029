"""DPF, dynamic pruning with feedback (Lin et al. 2020, "Dynamic Model Pruning with Feedback"), with and without
SMS (the paper's §4.3; docs/method.md §7): the dense weights are kept and trained with the gradient taken at the
masked weights; the mask is recomputed from the dense weights every ``dpf_interval`` iterations on GMP's schedule of
targets, so a pruned weight can come back.

The whole method is this file: its masking policy (handed to the trainer), its callback, its run (GMP's, with
these two and a re-pruned mean as the soup: each copy moves its own mask) and its registration.
"""

from __future__ import annotations

import torch

from ..pruning.enforcement import MaskingPolicy
from ..registry import PRUNING_METHODS
from .common import check_pruning_steps
from .gmp import GradualPruning, gradual, preflight, pruning_targets, sparsity_at


class FeedbackMasking(MaskingPolicy):
    """DPF's masking: the weights stay dense between steps; forward and backward (and evaluation) run at the masked
    weights, the optimizer updates the dense ones with the unmasked gradient (the error feedback). The masks a
    trainer starts with are not applied to the weights. When training ends the current mask is applied to the
    weights and the optimizer state, so the model is sparse, unless ``keep_dense`` (a run that continues: the
    part of DPF+SMS before its copies, and the copies, whose dense values the soup averages).
    """

    zeroes_at_start = False

    def __init__(self, keep_dense: bool = False):
        super().__init__()
        self.keep_dense = keep_dense

    def forward_context(self):
        return self.enforcer.masked_weights()

    def end(self, optimizer) -> None:
        if not self.keep_dense:
            self.enforcer.after_step(optimizer)

    @torch.no_grad()
    def sparsity(self) -> float:
        """The mask's sparsity (the dense weights have no zeros to count)."""
        masks = self.enforcer.masks.values()
        return sum(m.numel() - int(torch.count_nonzero(m)) for m in masks) / max(sum(m.numel() for m in masks), 1)


class DynamicPruning(GradualPruning):
    """DPF (Lin et al. 2020, "Dynamic Model Pruning with Feedback") in one SparseSoupTrainer run.

    Trains under :class:`FeedbackMasking`: the weights stay dense; each step's forward and backward run at the
    masked weights and the (unmasked) gradient updates the dense weights, so pruned weights keep learning.
    Every ``interval`` global iterations, and at each of GMP's pruning iterations, the mask is recomputed
    from the dense weights at :func:`sparsity_at` (GMP's current target; no mask before its first pruning
    step): a weight that grew back is kept again. When training ends the current mask is applied to the
    weights and the optimizer state, so the returned model is sparse and masks are exact from then on.
    The recompute at pruning iterations (not only every ``interval``) reaches each target when GMP does.
    """

    def __init__(
        self,
        n_steps: int,
        target: float,
        allocation: str | None = None,
        interval: int = 16,
        example_inputs=None,
        **pruning,
    ):
        super().__init__(n_steps, target, allocation, example_inputs, **pruning)
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval (iterations between mask updates) must be an integer >= 1, got {interval!r}")
        self.interval = interval

    def bind_trainer(self, trainer) -> None:
        super().bind_trainer(trainer)
        if not isinstance(trainer.masking, FeedbackMasking):  # used on its own: install DPF's masking
            trainer.set_masking(FeedbackMasking())

    def _sparsity_to_prune(self, iteration: int, total: int) -> float | None:
        due = iteration in pruning_targets(total, self.n_steps, self.target) or iteration % self.interval == 0
        sparsity = sparsity_at(iteration, total, self.n_steps, self.target)
        return sparsity if due and sparsity > 0 else None

    def _prune(self, sparsity: float, optimizer) -> None:
        # From the dense weights and without the old masks: a pruned weight that grew large comes back.
        masks = self.plan.masks(self.trainer.model, sparsity, example_inputs=self.example_inputs)
        self.trainer.set_masks(masks)


def dpf(ctx):
    """DPF through GMP's run: the plain run and every SMS copy train under :class:`FeedbackMasking` with a
    :class:`DynamicPruning` callback. With SMS the copies keep their dense weights and are averaged as they are
    (the ``mean`` soup: what DPF trains is the dense weights); each phase's mask is computed from that mean without
    zeroing it, and a phase's soup is the mean under its mask."""
    a = ctx.args

    def callback():
        return DynamicPruning(
            a.pruning_steps, a.target_sparsity, interval=a.dpf_interval, example_inputs=ctx.example, plan=a.plan
        )

    def plain(continues: bool) -> dict:
        return {"callbacks": [callback()], "masking": FeedbackMasking(keep_dense=continues)}

    def copy() -> dict:
        return {"callbacks": [callback()], "masking": FeedbackMasking(keep_dense=True)}

    return gradual(ctx, plain, copy, "mean", dense_phases=True)


def _check(config) -> None:
    check_pruning_steps(config)
    if config.num_replicas > 1 and config.merge_methods != ["uniform"]:
        raise ValueError(
            f"DPF's copies each move their own mask and keep dense weights, so their soup is the uniform mean of those "
            f"(masked by the next pruning step); merge_methods={config.merge_methods} cannot apply: use ['uniform']"
        )
    if not isinstance(config.dpf_interval, int) or config.dpf_interval < 1:
        raise ValueError(f"dpf_interval must be an integer >= 1 (iterations), got {config.dpf_interval!r}")


PRUNING_METHODS.add(
    "dpf",
    dpf,
    check=_check,
    preflight=preflight,
    during_training=True,
    tiny={"max_steps": 8, "pruning_steps": 2, "dpf_interval": 2},
)

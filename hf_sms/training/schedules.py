"""Retraining learning-rate schedules FT, LRW, SLR, CLR, LLR, ALLR (docs/method.md §3).

Zimmer et al. 2021, "How I Learned to Stop Worrying and Love Retraining". Each schedule is a pure
function ``lr(step, ctx)``; :func:`make_lr_scheduler` wraps one in a torch ``LambdaLR``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import PRETRAIN_SHAPES, RETRAIN_SCHEDULES

# Shapes of the original (pre)training schedule on normalised time u in [0, 1]: shape(u, lr_max, lr_min).
PRETRAIN_SHAPES.add("linear", lambda u, hi, lo: hi + (lo - hi) * u)
PRETRAIN_SHAPES.add("cosine", lambda u, hi, lo: lo + (hi - lo) * 0.5 * (1.0 + math.cos(math.pi * u)))
# A generic step decay (x0.1 at 50% and 75%), none of the paper's; those follow below by name.
PRETRAIN_SHAPES.add("step", lambda u, hi, lo: hi * (1.0 if u < 0.5 else 0.1 if u < 0.75 else 0.01))
# The paper's ResNet-18 / CIFAR-10 pretraining: x0.1 at epochs 90 and 180 of 200.
PRETRAIN_SHAPES.add("step_cifar", lambda u, hi, lo: hi * (1.0 if u < 0.45 else 0.1 if u < 0.9 else 0.01))
PRETRAIN_SHAPES.add("constant", lambda u, hi, lo: hi)
# The paper's ablations (WRN-20 on CIFAR-100, 200 epochs): 0.1, then x0.2 at epochs 60, 120 and 160.
PRETRAIN_SHAPES.add("step_ablation", lambda u, hi, lo: hi * 0.2 ** sum(u >= b for b in (0.3, 0.6, 0.8)))


def _warmup_then_steps(warmup: float, bounds: tuple[float, ...]):
    """The paper's step schedules (its appendix table, epoch t of E as u = t/E): linear warm-up to the peak over
    ``warmup``, the peak until ``bounds[0]``, then x0.1 at every further bound."""

    def shape(u, hi, lo):
        if u < warmup:
            return hi * u / warmup
        return hi * 0.1 ** sum(u >= b for b in bounds)

    return shape


def _add_warmed_steps(name: str, warmup: float, bounds: tuple[float, ...]) -> None:
    PRETRAIN_SHAPES.add(name, _warmup_then_steps(warmup, bounds), warmup=warmup)  # SLR reads the warm-up's length


# MaxViT on ImageNet, 200 epochs: warm-up over 20, 0.2 to 60, then x0.1 at 60, 120 and 160.
_add_warmed_steps("step_maxvit", 20 / 200, (60 / 200, 120 / 200, 160 / 200))
# PSPNet on Cityscapes, 300 epochs: warm-up over 20, 0.1 to 100, then x0.1 at 100, 200, 270 and 290.
_add_warmed_steps("step_pspnet", 20 / 300, (100 / 300, 200 / 300, 270 / 300, 290 / 300))
# T5-small on WMT16, 5 epochs: warm-up over 1, 0.1 to 2, then x0.1 at 2, 3 and 4.
_add_warmed_steps("step_t5", 1 / 5, (2 / 5, 3 / 5, 4 / 5))


@dataclass(frozen=True)
class ScheduleContext:
    """What a retraining schedule needs to know.

    Attributes:
        total_steps: retraining iterations R of this phase.
        lr_max: eta_max, the peak rate of the original training.
        lr_min: eta_min, the smallest rate of the original training after warm-up.
        pretrain_shape: name in ``PRETRAIN_SHAPES`` of the original schedule (LRW, SLR).
        length_ratio: R / T, retraining length over original training length (in epochs).
        start_lr: ALLR's start rate eta_0 (see :func:`allr_start_lr`).
        n_warmup: warm-up iterations of SLR, CLR, LLR and ALLR (default: ``ceil(0.1 R)``, the paper's 10%).
    """

    total_steps: int
    lr_max: float
    lr_min: float = 0.0
    pretrain_shape: str = "linear"
    length_ratio: float = 1.0
    start_lr: float | None = None
    n_warmup: int | None = None

    def original(self, u: float) -> float:
        return PRETRAIN_SHAPES[self.pretrain_shape](min(max(u, 0.0), 1.0), self.lr_max, self.lr_min)

    @property
    def warmup_steps(self) -> int:
        return math.ceil(0.1 * self.total_steps) if self.n_warmup is None else min(self.n_warmup, self.total_steps)


def _with_warmup(step: int, ctx: ScheduleContext, start: float, decay: Callable[[float], float]) -> float:
    """Cosine warm-up over ``ctx.warmup_steps`` steps from 0 to ``start``, then ``decay(tau)``, tau in [0, 1]."""
    w = ctx.warmup_steps
    if step < w:
        return start * 0.5 * (1.0 - math.cos(math.pi * step / w))
    return decay(min((step - w) / max(ctx.total_steps - w, 1), 1.0))


def ft(step: int, ctx: ScheduleContext) -> float:
    """Fine-tuning: constant eta_min."""
    return ctx.lr_min


def lrw(step: int, ctx: ScheduleContext) -> float:
    """Learning-rate rewinding: the last R rates of the original schedule."""
    return ctx.original(1.0 - ctx.length_ratio + ctx.length_ratio * step / max(ctx.total_steps, 1))


def slr(step: int, ctx: ScheduleContext) -> float:
    """Scaled restarting: the original schedule compressed into R iterations, starting at eta_max. An original
    schedule that warms up (MaxViT's, PSPNet's, T5's) runs at its peak over its warm-up part instead, as the paper's
    code does: SLR's own warm-up replaces it, so the rate never falls back to 0 after warming up."""
    warmup = PRETRAIN_SHAPES.meta(ctx.pretrain_shape).get("warmup", 0.0)
    return _with_warmup(step, ctx, ctx.lr_max, lambda t: ctx.lr_max if t < warmup else ctx.original(t))


def clr(step: int, ctx: ScheduleContext) -> float:
    """Cyclic restarting: cosine from eta_max to eta_min."""
    return _with_warmup(step, ctx, ctx.lr_max, lambda t: PRETRAIN_SHAPES["cosine"](t, ctx.lr_max, ctx.lr_min))


def llr(step: int, ctx: ScheduleContext) -> float:
    """Linear restarting: linear from eta_max to 0."""
    return _with_warmup(step, ctx, ctx.lr_max, lambda t: ctx.lr_max * (1.0 - t))


def allr(step: int, ctx: ScheduleContext) -> float:
    """Adaptive linear restarting: LLR from ``ctx.start_lr`` (see :func:`allr_start_lr`)."""
    if ctx.start_lr is None:
        raise ValueError("ALLR needs start_lr; compute it with allr_start_lr() from the pruning step's norm drop")
    return _with_warmup(step, ctx, ctx.start_lr, lambda t: ctx.start_lr * (1.0 - t))


for _schedule in (ft, lrw, slr, clr, llr, allr):  # lr(step, ctx) each
    RETRAIN_SCHEDULES.add(_schedule.__name__, _schedule)


def steps_per_epoch(num_examples: int, batch_size: int, world_size: int, accumulation: int) -> int:
    """Optimizer steps in one pass over ``num_examples`` split across ``world_size`` ranks."""
    batches = math.ceil(num_examples / (batch_size * world_size))
    return max(math.ceil(batches / accumulation), 1)


def allr_start_lr(norm_fraction: float, phase_fraction: float, lr_max: float, length_ratio: float) -> float:
    """ALLR's start rate ``clip(d / sqrt(q) * eta_max, min(R/T, 1) * eta_max, eta_max)``.

    Args:
        norm_fraction: d, relative norm of the weights this phase pruned
            (:func:`hf_sms.pruning.masks.pruned_norm_fraction`).
        phase_fraction: q, fraction of the weights pruned in this phase (not the cumulative sparsity).
        lr_max: eta_max of the original training.
        length_ratio: R / T in epochs.
    """
    if phase_fraction <= 0:
        return lr_max  # nothing pruned: behave like LLR
    lo = min(length_ratio, 1.0) * lr_max
    return min(max(norm_fraction / math.sqrt(phase_fraction) * lr_max, lo), lr_max)


def make_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, ctx: ScheduleContext):
    """A ``LambdaLR`` following schedule ``name``; the optimizer's initial lr is the unit it scales."""
    fn = RETRAIN_SCHEDULES.get(name)
    group = optimizer.param_groups[0]
    base = group.get("initial_lr", group["lr"])  # a second train() finds the last schedule's end rate in "lr"
    if base <= 0:
        raise ValueError("the optimizer's learning rate must be > 0 to scale a retraining schedule")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: fn(step, ctx) / base)

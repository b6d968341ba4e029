"""Learned soup (Wortsman et al. 2022, appendix I, "learned soup by layer"): mixing weights over the candidates,
one softmax per parameter tensor (or per module), fitted by gradient descent on held-out data, starting from the
uniform soup. The reference code (mlfoundations/model-soups ``learned_bylayer.py``) holds every candidate and
recomputes the mix each step: AdamW, lr 0.05, no weight decay, 5 epochs over 2% of ImageNet held out (25.6k
images in batches of 256: 500 steps). The defaults are these, the length in steps (500), since a held-out share
of a small task's validation set would give 5 epochs of a handful of steps.

Memory: the candidates (m models, in their own dtype, wherever they are), the mixed parameters (one model), their
gradients (one model) and one forward's activations; the mixing weights are scalars, so a weight all candidates
prune stays exactly zero. Its logit scale ``beta`` is left out: it only tempers a classifier's loss and is not
part of the soup.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..registry import SOUPS
from ..seeding import EpochShuffleSampler
from .averaging import average_tensors
from .method import Option, SoupMethod
from .uniform import uniform_weights

StateDict = dict[str, torch.Tensor]
_BN = nn.modules.batchnorm._BatchNorm


@dataclass(frozen=True)
class FitData:
    """What a learned soup fits on: held-out data no other soup selects on (the loop splits it off the validation
    set, ``soup_options["learned"]["fraction"]``), in batches of ``batch_size``; ``loss(model, batch)`` the
    training loss of a model (the run's: the model's own, ``compute_loss_func`` or cross-entropy)."""

    dataset: object
    batch_size: int
    collate: Callable
    loss: Callable[[nn.Module, object], torch.Tensor]


class _Mix(torch.autograd.Function):
    """``sum_i alpha_i * tensors_i`` into one new tensor, differentiable in ``alpha`` only: no temporaries of the
    tensor's size in the forward (in-place multiply-adds) or the backward (one dot product per candidate)."""

    @staticmethod
    def forward(ctx, alpha: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)  # references to the candidates, not copies
        out = torch.zeros_like(tensors[0], dtype=torch.promote_types(tensors[0].dtype, torch.float32))
        for i, tensor in enumerate(tensors):
            out.addcmul_(tensor, alpha[i])
        return out.to(tensors[0].dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.reshape(-1).float()
        dots = [torch.dot(g, t.reshape(-1).float()) for t in ctx.saved_tensors]
        return (torch.stack(dots), *[None] * len(dots))


class _Mixed(nn.Module):
    """``template``'s forward with its parameters replaced by the mix of the candidates' (differentiable in the
    mixing weights only)."""

    def __init__(self, template: nn.Module, tensors: Callable[[], StateDict]):
        super().__init__()
        self.template, self.tensors = template, tensors

    def forward(self, *args, **kwargs):
        return torch.func.functional_call(self.template, self.tensors(), args, kwargs, strict=False)


def fit_mixing(
    states: Sequence[StateDict], template: nn.Module, data: FitData, options: dict, seed: int
) -> dict[str, list[float]]:
    """``{parameter name: one weight per candidate}`` (each a softmax: positive, summing to 1), fitted on
    ``data`` for ``options["steps"]`` steps (as many passes as that takes) at ``options["lr"]``;
    ``options["per_module"]``: one softmax per module instead of per tensor. BatchNorm normalises with batch
    statistics during the fit (its running statistics are about to be recomputed) and dropout is off, so the fit
    is deterministic given ``seed``."""
    if not len(data.dataset):
        raise ValueError("the learned soup has no examples to fit on: give it a larger validation set or fraction")
    m, model = len(states), template  # its own parameters are never read: no copy of the model
    names = [n for n, p in model.named_parameters() if p.is_floating_point()]
    group = {n: n.rsplit(".", 1)[0] if options["per_module"] else n for n in names}
    index = {g: k for k, g in enumerate(dict.fromkeys(group.values()))}
    logits = torch.zeros(len(index), m, requires_grad=True)  # softmax(0) = 1/m: the uniform soup, as the reference
    optimizer = torch.optim.AdamW([logits], lr=options["lr"], weight_decay=0.0)
    kept = [n for n, _ in model.named_buffers() if n in states[0]]  # persistent ones: BatchNorm's statistics
    buffers = {n: average_tensors([s[n] for s in states]) for n in kept}  # the fit's own: BatchNorm writes them
    device = next(template.parameters()).device

    def tensors() -> StateDict:  # in the candidates' dtype: the model runs as they do
        alpha = logits.softmax(1).to(device)
        mixed = {n: _Mix.apply(alpha[index[group[n]]], *(s[n].to(device) for s in states)) for n in names}
        return {**mixed, **buffers}

    mixed = _Mixed(model, tensors)
    sampler = EpochShuffleSampler(len(data.dataset), seed)
    loader = DataLoader(data.dataset, data.batch_size, sampler=sampler, collate_fn=data.collate)
    modes = {module: module.training for module in model.modules()}
    for module in model.modules():  # batch statistics in BatchNorm, dropout off
        module.train(isinstance(module, _BN))
    try:
        steps, epoch = int(options["steps"]), 0
        while steps > 0:  # whole passes over the fit split, each in its own order, until the steps are done
            sampler.set_epoch(epoch)
            for batch in itertools.islice(loader, steps):
                optimizer.zero_grad()
                loss = data.loss(mixed, batch)
                if not torch.isfinite(loss.detach()).all():  # its weights would be NaN: a soup of nothing
                    step = int(options["steps"]) - steps + 1
                    raise ValueError(
                        f"the learned soup's fit loss is {float(loss.detach()):g} at step {step}: "
                        "its candidates give non-finite outputs on the fit data, or soup_options['learned']['lr'] is "
                        "too high; lower it, or use another merge method"
                    )
                loss.backward()
                optimizer.step()
                steps -= 1
            epoch += 1
    finally:
        for module, training in modes.items():
            module.training = training
    alpha = logits.detach().softmax(1)
    return {n: alpha[index[group[n]]].tolist() for n in names}


LEARNED_OPTIONS = (
    Option("lr", 0.05, 0.0, open_low=True, help="AdamW's learning rate for the mixing weights (the reference's)"),
    Option("steps", 500, 1, 1e6, integer=True, help="AdamW steps (the reference: 5 epochs of 100 batches)"),
    Option("fraction", 0.5, 0.0, 0.9, open_low=True, help="share of the validation set split off for the fit"),
    Option("per_module", 0, 0, 1, integer=True, help="1: one softmax per module (weight and bias); 0: per tensor"),
)
SOUPS.add("learned", SoupMethod(uniform_weights, fit=fit_mixing, options=LEARNED_OPTIONS, needs_validation=True))

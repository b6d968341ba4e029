"""Learned soup (Wortsman et al. 2022, appendix I, "learned soup by layer"): mixing weights over the candidates,
one softmax per parameter tensor (or per module), fitted by gradient descent on held-out data, starting from the
uniform soup. The reference code (mlfoundations/model-soups ``learned_bylayer.py``) holds every candidate and
recomputes the mix each step: AdamW, lr 0.05, 5 epochs, no weight decay; its defaults are these.

Memory: the candidates (m models, in their own dtype, wherever they are), the mixed parameters (one model), their
gradients (one model) and one forward's activations; the mixing weights are scalars, so a weight all candidates
prune stays exactly zero. Its logit scale ``beta`` is left out: it only tempers a classifier's loss and is not
part of the soup.
"""

from __future__ import annotations

import copy
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
    ``data`` for ``options["epochs"]`` epochs at ``options["lr"]``; ``options["per_module"]``: one softmax per
    module instead of per tensor. BatchNorm normalises with batch statistics during the fit (its running
    statistics are about to be recomputed) and dropout is off, so the fit is deterministic given ``seed``."""
    m = len(states)
    model = copy.deepcopy(template).eval()
    for module in model.modules():
        if isinstance(module, _BN):
            module.train()
    names = [n for n, p in model.named_parameters() if p.is_floating_point()]
    group = {n: n.rsplit(".", 1)[0] if options["per_module"] else n for n in names}
    index = {g: k for k, g in enumerate(dict.fromkeys(group.values()))}
    logits = torch.zeros(len(index), m, requires_grad=True)  # softmax(0) = 1/m: the uniform soup, as the reference
    optimizer = torch.optim.AdamW([logits], lr=options["lr"], weight_decay=0.0)
    buffers = {n: average_tensors([s[n] for s in states]) for n, _ in model.named_buffers()}  # the fit's own copies
    device = next(template.parameters()).device

    def tensors() -> StateDict:
        alpha = logits.softmax(1).to(device)
        mixed = {}
        for n in names:
            a = alpha[index[group[n]]]
            mix = sum(a[i] * states[i][n].to(device) for i in range(m))  # saves references, not copies
            mixed[n] = mix.to(states[0][n].dtype)  # the candidates' dtype: the model runs as they do
        return {**mixed, **buffers}

    mixed = _Mixed(model, tensors)
    sampler = EpochShuffleSampler(len(data.dataset), seed)
    loader = DataLoader(data.dataset, data.batch_size, sampler=sampler, collate_fn=data.collate)
    for epoch in range(int(options["epochs"])):
        sampler.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad()
            data.loss(mixed, batch).backward()
            optimizer.step()
    alpha = logits.detach().softmax(1)
    return {n: alpha[index[group[n]]].tolist() for n in names}


LEARNED_OPTIONS = (
    Option("lr", 0.05, 0.0, open_low=True, help="AdamW's learning rate for the mixing weights (the reference's)"),
    Option("epochs", 5, 1, 1000, integer=True, help="passes over the fit split (the reference's 5)"),
    Option("fraction", 0.5, 0.0, 0.9, open_low=True, help="share of the validation set split off for the fit"),
    Option("per_module", 0, 0, 1, integer=True, help="1: one softmax per module (weight and bias); 0: per tensor"),
)
SOUPS.add("learned", SoupMethod(uniform_weights, fit=fit_mixing, options=LEARNED_OPTIONS, needs_validation=True))

"""BatchNorm recalibration (docs/method.md §5): exact running statistics after a merge."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable, Mapping

import torch
from torch import nn

_BN = nn.modules.batchnorm._BatchNorm


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BN) and m.track_running_stats for m in model.modules())


def forward_batch(model: nn.Module, batch, device: torch.device | None = None, keep_labels: bool = False):
    """Run ``model`` on one batch: a dict, a tuple/list (all of it where ``forward`` takes that many positional
    inputs, else its first item, the inputs of an ``(inputs, labels)`` pair) or a tensor.

    ``labels`` are dropped from dicts unless ``keep_labels`` (seq2seq models derive decoder inputs from them).
    """
    if isinstance(batch, Mapping):  # dicts and transformers' BatchEncoding
        kwargs = {k: v.to(device) if device is not None and torch.is_tensor(v) else v for k, v in batch.items()}
        if not keep_labels:
            kwargs.pop("labels", None)
        return model(**kwargs)
    if isinstance(batch, (tuple, list)):
        items = [t.to(device) if device is not None and torch.is_tensor(t) else t for t in batch]
        if _takes_positional(model, len(items)):  # forward(x, y): the batch is its inputs
            return model(*items)
        # (inputs, labels), as torchvision's datasets give them, or a one-item tuple of a dict
        return forward_batch(model, batch[0], device, keep_labels)
    return model(batch.to(device) if device is not None else batch)


def _takes_positional(model: nn.Module, n: int) -> bool:
    """Whether ``model.forward`` takes ``n`` (> 1) positional arguments, two or more of them required (or ``*args``)."""
    if n < 2:
        return False
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return n <= len(positional) and len(required) > 1  # forward(x, y=None) keeps taking (inputs, labels) apart


@torch.no_grad()
def batchnorm_sums(
    model: nn.Module, batches: Iterable, seeds: Iterable[int] | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """``{BatchNorm name: (sum of batch means, sum of batch variances, batches)}`` over ``batches``, in float64.

    Forward passes run in train mode without gradients; each BatchNorm call contributes the mean and unbiased
    variance its train-mode forward computes (read from its running statistics under ``momentum=1``). Sums of
    several processes' batches add up to one process's over all of them. ``seeds`` (one per batch) seed torch's
    generators (CPU and every GPU) before each forward, so dropout and stochastic depth draw alike in whichever
    process runs the batch.
    """
    bns = {name: m for name, m in model.named_modules() if isinstance(m, _BN) and m.track_running_stats}
    sums = {name: [_zeros(bn), _zeros(bn), 0] for name, bn in bns.items()}

    def add(name):
        def hook(bn, args, output):  # added on the device: no host sync per call
            s = sums[name]
            s[0] += bn.running_mean.detach().to(s[0].device, torch.float64)
            s[1] += bn.running_var.detach().to(s[1].device, torch.float64)
            s[2] += 1

        return hook

    was_training, momenta = model.training, {name: bn.momentum for name, bn in bns.items()}
    handles = [bn.register_forward_hook(add(name)) for name, bn in bns.items()]
    for bn in bns.values():
        bn.momentum = 1.0  # the running statistics become this batch's
    device = next(model.parameters()).device
    model.train()
    try:
        for batch, seed in zip(batches, seeds if seeds is not None else itertools.repeat(None)):
            if seed is not None:
                torch.manual_seed(seed)
            forward_batch(model, batch, device)
    finally:
        for handle in handles:
            handle.remove()
        for name, bn in bns.items():
            bn.momentum = momenta[name]
        model.train(was_training)
    return {name: (s[0].cpu(), s[1].cpu(), s[2]) for name, s in sums.items()}


def _zeros(bn: nn.Module) -> torch.Tensor:
    device = bn.running_mean.device
    return torch.zeros(bn.num_features, dtype=torch.float64, device=device if device.type != "mps" else "cpu")


@torch.no_grad()
def recalibrate_batchnorm(
    model: nn.Module, batches: Iterable, max_batches: int | None = None, world=None, seeds: Iterable[int] | None = None
) -> nn.Module:
    """Reset every BatchNorm's running statistics and recompute them over ``batches``.

    The statistics are exact cumulative averages over the batches (what ``momentum=None`` gives, summed in
    float64), not exponential ones. Models without BatchNorm are returned untouched. ``batches`` should be the
    training data in a fixed order. ``world`` (``size``, ``all_gather``): the processes that share the pass, each
    with its own share of the batches; every one gets the statistics of all of them. ``seeds``: one per batch, set
    before its forward (see :func:`batchnorm_sums`); the caller's generators are then left changed.
    """
    bns = {name: m for name, m in model.named_modules() if isinstance(m, _BN) and m.track_running_stats}
    if not bns:
        return model
    sums = batchnorm_sums(model, itertools.islice(batches, max_batches), seeds)
    if world is not None and world.size > 1:
        parts = world.all_gather(sums)
        sums = {name: tuple(sum(p[name][k] for p in parts) for k in range(3)) for name in sums}
    if not any(n for _, _, n in sums.values()):  # resetting to mean 0, variance 1 would pass for statistics
        raise ValueError(
            "recalibrate_batchnorm got no batches (or none reached a BatchNorm): its statistics would be reset to "
            "mean 0 and variance 1. Pass the training data, e.g. a DataLoader over the training set"
        )
    for name, bn in bns.items():
        total_mean, total_var, n = sums[name]
        bn.reset_running_stats()
        if n:
            bn.running_mean.copy_(total_mean / n)
            bn.running_var.copy_(total_var / n)
            bn.num_batches_tracked.fill_(n)
    return model

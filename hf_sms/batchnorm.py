"""BatchNorm recalibration (docs/method.md §5): exact running statistics after a merge."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

_BN = nn.modules.batchnorm._BatchNorm


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BN) and m.track_running_stats for m in model.modules())


def forward_batch(model: nn.Module, batch, device: torch.device | None = None, keep_labels: bool = False):
    """Run ``model`` on one batch: a dict, a tuple/list (first item) or a tensor.

    ``labels`` are dropped from dicts unless ``keep_labels`` (seq2seq models derive decoder inputs from them).
    """
    if isinstance(batch, Mapping):  # dicts and transformers' BatchEncoding
        kwargs = {k: v.to(device) if device is not None and torch.is_tensor(v) else v for k, v in batch.items()}
        if not keep_labels:
            kwargs.pop("labels", None)
        return model(**kwargs)
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return model(batch.to(device) if device is not None else batch)


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches: Iterable, max_batches: int | None = None) -> nn.Module:
    """Reset every BatchNorm's running statistics and recompute them over ``batches``.

    Forward passes run in train mode without gradients and with ``momentum=None``, so the statistics
    are exact cumulative averages over the batches, not exponential ones. Models without BatchNorm
    are returned untouched. ``batches`` should be the training data in a fixed order.
    """
    bns = [m for m in model.modules() if isinstance(m, _BN) and m.track_running_stats]
    if not bns:
        return model
    was_training = model.training
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    device = next(model.parameters()).device
    model.train()
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            forward_batch(model, batch, device)
    finally:
        for bn, momentum in zip(bns, momenta):
            bn.momentum = momentum
        model.train(was_training)
    return model

"""Metrics the SMS loop records: accuracy, the prediction ensemble, and averageability diagnostics."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import default_data_collator

from .batchnorm import forward_batch

MetricFn = Callable[[nn.Module, object], float]


def _logits(outputs) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs


@torch.no_grad()
def predict_proba(
    model: nn.Module, dataset, batch_size: int = 256, collate_fn=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities and labels of a classifier over ``dataset`` (dicts with a ``labels`` key)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    probs, labels = [], []
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn or default_data_collator):
        probs.append(_logits(forward_batch(model, batch, device)).float().softmax(-1).cpu())
        labels.append(batch["labels"])
    model.train(was_training)
    return torch.cat(probs), torch.cat(labels)


def classification_metrics(batch_size: int = 256, collate_fn=None) -> tuple[MetricFn, Callable]:
    """``(accuracy, ensemble_accuracy)`` for classifiers: top-1 accuracy in %, and the accuracy of the
    averaged softmax of several models (the prediction ensemble, METHOD §8)."""

    def accuracy(model: nn.Module, dataset) -> float:
        probs, labels = predict_proba(model, dataset, batch_size, collate_fn)
        return 100.0 * float((probs.argmax(-1) == labels).float().mean())

    def ensemble_accuracy(models: Sequence[nn.Module], dataset) -> float:
        outs = [predict_proba(m, dataset, batch_size, collate_fn) for m in models]
        probs = torch.stack([p for p, _ in outs]).mean(0)
        return 100.0 * float((probs.argmax(-1) == outs[0][1]).float().mean())

    return accuracy, ensemble_accuracy


@torch.no_grad()
def pairwise_l2(models: Sequence[nn.Module]) -> list[float]:
    """L2 distance between every pair of models' parameters (METHOD §8: jumps when averaging breaks)."""
    flat = [torch.cat([p.detach().float().reshape(-1).cpu() for p in m.parameters()]) for m in models]
    return [float(torch.linalg.vector_norm(a - b)) for a, b in itertools.combinations(flat, 2)]

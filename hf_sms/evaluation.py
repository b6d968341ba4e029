"""Metrics the SMS loop records: accuracy and the prediction ensemble."""

from __future__ import annotations

from collections.abc import Callable

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


class ClassificationAccuracy:
    """Top-1 accuracy in % as a metric for the SMS loop: ``metric(model, dataset) -> float``.

    It also defines ``predict(model, dataset)`` (softmax probabilities) and ``score(probs, dataset)``, which
    the loop uses for the prediction-ensemble diagnostic (METHOD §8); any metric object with those two
    methods gets the ensemble row.
    """

    def __init__(self, batch_size: int = 256, collate_fn=None):
        self.batch_size, self.collate_fn = batch_size, collate_fn

    def predict(self, model: nn.Module, dataset) -> torch.Tensor:
        return predict_proba(model, dataset, self.batch_size, self.collate_fn)[0]

    def score(self, probs: torch.Tensor, dataset) -> float:
        labels = torch.cat([b["labels"] for b in DataLoader(dataset, self.batch_size, collate_fn=self._collate)])
        return 100.0 * float((probs.argmax(-1) == labels).float().mean())

    def __call__(self, model: nn.Module, dataset) -> float:
        probs, labels = predict_proba(model, dataset, self.batch_size, self.collate_fn)
        return 100.0 * float((probs.argmax(-1) == labels).float().mean())

    @property
    def _collate(self):
        return self.collate_fn or default_data_collator

"""Metrics the SMS loop scores models with: top-1 accuracy (with the prediction ensemble), BLEU, mean IoU, and any
``evaluate`` module (:class:`EvaluateMetric`).

A metric is ``metric(model, dataset) -> float``, higher is better. The built-in ones are batch metrics
(:mod:`hf_sms.evaluation.sharded`): exact statistics per batch, combined, so a run's processes share the work and
get one process's value to the last digit. They read their data through a
``DataLoader`` with ``loader_kwargs`` (workers, pinned memory) and ``batch_size``, which the loop fills from the
run's config (``dataloader_num_workers``, ``dataloader_pin_memory``, ``per_device_eval_batch_size``) unless set: at
ImageNet scale every phase evaluates m candidates, soups and baselines on 50k images.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import default_data_collator

from ..batchnorm import forward_batch
from .sharded import evaluate, evaluating

MetricFn = Callable[[nn.Module, object], float]


def _logits(outputs) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs


@torch.no_grad()
def predict_proba(
    model: nn.Module, dataset, batch_size: int = 256, collate_fn=None, loader_kwargs: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities and labels of a classifier over ``dataset`` (dicts with a ``labels`` key)."""
    probs, labels = [], []
    loader = DataLoader(dataset, batch_size, collate_fn=collate_fn or default_data_collator, **(loader_kwargs or {}))
    with evaluating(model) as device:
        for batch in loader:
            probs.append(_logits(forward_batch(model, batch, device)).float().softmax(-1).cpu())
            labels.append(batch["labels"])
    return torch.cat(probs), torch.cat(labels)


class ClassificationAccuracy:
    """Top-1 accuracy in % as a metric for the SMS loop: ``metric(model, dataset) -> float``.

    It also defines ``predict(model, dataset)`` (softmax probabilities) and ``score(probs, dataset)``, which
    the loop uses for the prediction-ensemble diagnostic (docs/method.md §8); any metric object with those two
    methods gets the ensemble row.
    """

    name = "top-1 accuracy"

    def __init__(self, batch_size: int | None = None, collate_fn=None, loader_kwargs: dict | None = None):
        self.batch_size, self.collate_fn, self.loader_kwargs = batch_size or 256, collate_fn, dict(loader_kwargs or {})
        self.batch_size_open = batch_size is None  # a run sets its per_device_eval_batch_size
        self._last: tuple | None = None  # (dataset, labels) of the last predict: score() reads the data once

    def predict(self, model: nn.Module, dataset) -> torch.Tensor:
        return self.predict_targets(model, dataset)[0]

    def predict_targets(self, model: nn.Module, dataset) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probabilities, labels)``: what :meth:`score_targets` takes (the processes holding a replica share
        this pass, :func:`hf_sms.evaluation.sharded.predict_shared`)."""
        probs, labels = predict_proba(model, dataset, self.batch_size, self.collate_fn, self.loader_kwargs)
        self._last = (dataset, labels)
        return probs, labels

    def score_targets(self, probs: torch.Tensor, labels: torch.Tensor) -> float:
        return 100.0 * float((probs.argmax(-1) == labels).float().mean())

    def score(self, probs: torch.Tensor, dataset) -> float:
        if self._last is not None and self._last[0] is dataset:
            labels = self._last[1]
        else:
            loader = DataLoader(dataset, self.batch_size, collate_fn=self._collate, **self.loader_kwargs)
            labels = torch.cat([b["labels"] for b in loader])
        return self.score_targets(probs, labels)

    def batch_statistics(self, model: nn.Module, batch, device) -> tuple[int, int]:
        pred = _logits(forward_batch(model, batch, device)).argmax(-1).cpu()
        return int((pred == batch["labels"]).sum()), int(batch["labels"].numel())

    def finish(self, statistics: list[tuple[int, int]]) -> float:
        correct, count = (sum(s[i] for s in statistics) for i in (0, 1))
        return 100.0 * correct / count

    def __call__(self, model: nn.Module, dataset) -> float:
        return evaluate(self, model, dataset)  # one process; the loop passes its processes

    @property
    def _collate(self):
        return self.collate_fn or default_data_collator


class BleuMetric:
    """Corpus BLEU (sacrebleu) of greedy or beam-search generations against ``labels`` (seq2seq models)."""

    name = "BLEU"

    def __init__(
        self, tokenizer, max_new_tokens: int = 128, num_beams: int = 1, batch_size: int | None = None, collate_fn=None
    ):
        self.tokenizer, self.max_new_tokens, self.num_beams = tokenizer, max_new_tokens, num_beams
        self.batch_size, self.collate_fn = batch_size or 64, collate_fn or default_data_collator
        self.batch_size_open = batch_size is None  # a run generates in batches of its per_device_eval_batch_size
        self.loader_kwargs: dict = {}

    def batch_statistics(self, model: nn.Module, batch, device) -> tuple[list[str], list[str]]:
        out = model.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            max_new_tokens=self.max_new_tokens,
            num_beams=self.num_beams,
        )
        labels = batch["labels"].masked_fill(batch["labels"] == -100, self.tokenizer.pad_token_id)
        hyps = self.tokenizer.batch_decode(out, skip_special_tokens=True)
        return [h.strip() for h in hyps], [
            r.strip() for r in self.tokenizer.batch_decode(labels, skip_special_tokens=True)
        ]

    def finish(self, statistics: list[tuple[list[str], list[str]]]) -> float:
        import sacrebleu

        hyps, refs = [h for s in statistics for h in s[0]], [r for s in statistics for r in s[1]]
        return float(sacrebleu.corpus_bleu(hyps, [refs]).score)

    def __call__(self, model: nn.Module, dataset) -> float:
        return evaluate(self, model, dataset)  # one process; the loop passes its processes


class NegativePerplexity:
    """Perplexity of a causal language model on ``labels`` (next-token, -100 ignored), negated: the loop picks
    soups by a metric that is higher when better, so a run reports ``-perplexity`` (``-12.3`` is perplexity 12.3).
    Exact token-weighted statistics per batch, so a run's processes share it."""

    name = "negative perplexity"

    def __init__(self, batch_size: int | None = None, collate_fn=None):
        self.batch_size, self.collate_fn = batch_size or 8, collate_fn or default_data_collator
        self.batch_size_open = batch_size is None  # a run reads in batches of its per_device_eval_batch_size
        self.loader_kwargs: dict = {}

    def batch_statistics(self, model: nn.Module, batch, device) -> tuple[float, int]:
        logits = _logits(forward_batch(model, batch, device)).float()[:, :-1]
        labels = batch["labels"].to(logits.device)[:, 1:]
        flat = logits.reshape(-1, logits.shape[-1])
        nll = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum")
        return float(nll), int((labels != -100).sum())

    def finish(self, statistics: list[tuple[float, int]]) -> float:
        tokens = sum(n for _, n in statistics)
        return -math.exp(sum(s for s, _ in statistics) / tokens) if tokens else math.nan

    def __call__(self, model: nn.Module, dataset) -> float:
        return evaluate(self, model, dataset)  # one process; the loop passes its processes


class MeanIoU:
    """Mean intersection over union in % for segmentation logits ``(N, C, H, W)`` vs ``labels`` ``(N, H, W)``.

    Pixels labelled ``ignore_index`` are skipped; classes absent from both prediction and labels are
    left out of the mean.
    """

    name = "mIoU"

    def __init__(self, num_classes: int, batch_size: int | None = None, ignore_index: int = -100, collate_fn=None):
        self.num_classes, self.batch_size, self.ignore_index = num_classes, batch_size or 16, ignore_index
        self.batch_size_open = batch_size is None  # a run sets its per_device_eval_batch_size
        self.collate_fn = collate_fn or default_data_collator
        self.loader_kwargs: dict = {}

    def batch_statistics(self, model: nn.Module, batch, device) -> torch.Tensor:
        pred = _logits(forward_batch(model, batch, device)).argmax(1).cpu()
        labels = batch["labels"]
        keep = labels != self.ignore_index
        idx = labels[keep] * self.num_classes + pred[keep]
        return torch.bincount(idx, minlength=self.num_classes**2).view(self.num_classes, -1)

    def finish(self, statistics: list[torch.Tensor]) -> float:
        confusion = torch.stack(statistics).sum(0) if statistics else torch.zeros(self.num_classes, self.num_classes)
        inter = confusion.diag().double()
        union = confusion.sum(0).double() + confusion.sum(1).double() - inter
        present = union > 0
        return 100.0 * float((inter[present] / union[present]).mean()) if present.any() else 0.0

    def __call__(self, model: nn.Module, dataset) -> float:
        return evaluate(self, model, dataset)  # one process; the loop passes its processes


class EvaluateMetric:
    """An ``evaluate`` module (``evaluate.load("accuracy")``, or a local metric script offline) as a metric of the
    loop: predictions are the argmax of the model's logits over the last dimension (class scores) or dimension 1
    (segmentation maps), references the data's ``labels``, and the value is ``module.compute(...)[key]``.
    ``SparseModelSoup`` wraps an ``evaluate`` module passed as a metric in this itself.

    Args:
        module: the ``evaluate`` module.
        key: which entry of ``compute``'s dict (default: the module's name, else the only entry).
        batch_size, collate_fn, loader_kwargs: how the data is read (batch size: a run's
            ``per_device_eval_batch_size`` unless given, else 256).
    """

    def __init__(
        self, module, key: str | None = None, batch_size: int | None = None, collate_fn=None, loader_kwargs=None
    ):
        self.module, self.key = module, key
        self.batch_size, self.collate_fn, self.loader_kwargs = batch_size or 256, collate_fn, dict(loader_kwargs or {})
        self.batch_size_open = batch_size is None  # a run sets its per_device_eval_batch_size
        self.name = getattr(module, "name", None) or type(module).__name__

    def batch_statistics(self, model: nn.Module, batch, device) -> tuple[list, list]:
        logits = _logits(forward_batch(model, batch, device))
        predictions = logits.argmax(1 if logits.dim() > 2 else -1).cpu().reshape(-1)
        return predictions.tolist(), batch["labels"].reshape(-1).tolist()

    def finish(self, statistics: list[tuple[list, list]]) -> float:
        # add_batch per batch, in the order one process reads them, then one compute: the module's own reduction
        for predictions, references in statistics:
            self.module.add_batch(predictions=predictions, references=references)
        result = self.module.compute()
        key = self.key or (self.name if self.name in result else next(iter(result)))
        return float(result[key])

    def __call__(self, model: nn.Module, dataset) -> float:
        return evaluate(self, model, dataset)  # one process; the loop passes its processes


def as_metric(metric):
    """``metric`` as the loop calls metrics: an ``evaluate`` module is wrapped in :class:`EvaluateMetric`."""
    # an evaluate.EvaluationModule by its interface (importing evaluate costs seconds that no other run needs)
    if not callable(metric) and hasattr(metric, "compute") and hasattr(metric, "add_batch"):
        return EvaluateMetric(metric)
    halves = [hasattr(metric, m) for m in ("batch_statistics", "finish")]
    if any(halves) and not all(halves):
        raise ValueError(
            f"{type(metric).__name__} defines only one of batch_statistics and finish: a metric a run's processes "
            "share needs both (exact statistics per batch, and the value from all of them; docs/parallel.md)"
        )
    return metric

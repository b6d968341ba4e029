"""Evaluation shared by the run's processes: each reads every N-th batch of a set, the metric combines exact
statistics, and every process gets the value one process computes.

A *batch metric* has ``batch_size``, ``collate_fn``, ``loader_kwargs`` and two methods:
``batch_statistics(model, batch, device) -> stats`` (exact and picklable: counts, a confusion matrix, decoded
strings) and ``finish([stats of every batch, in order]) -> float``. Batches are the ones a single process reads
(same size, same order), only dealt out, so the value is the same to the last digit on any number of processes.
A plain ``metric(model, dataset) -> float`` cannot be combined: the main process computes it and shares the value.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from transformers import default_data_collator
from transformers.trainer_utils import has_length

from ..batchnorm import recalibrate_batchnorm
from ..data import SeededItems, kept_randomness
from ..seeding import derive_seed

logger = logging.getLogger(__name__)
_NOTED: set[str] = set()


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[torch.device]:
    """Eval mode inside the block, the model's training mode restored after (also on error); yields its device."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


class OneProcess:
    """The world of a single process (``ReplicaWorld`` has the same ``size``, ``rank``, ``is_main``,
    ``all_gather``)."""

    size, rank, is_main = 1, 0, True

    def all_gather(self, value) -> list:
        return [value]


def is_batch_metric(metric) -> bool:
    return hasattr(metric, "batch_statistics") and hasattr(metric, "finish")


def owned_batches(n_examples: int, batch_size: int, rank: int, size: int) -> tuple[list[int], list[int]]:
    """``(batches, example indices)`` of ``rank``: batch ``b`` (of ``batch_size`` consecutive examples) belongs to
    rank ``b % size``, so every batch is the one a single process would read."""
    batches = list(range(rank, math.ceil(n_examples / batch_size), size))
    return batches, [i for b in batches for i in range(b * batch_size, min(n_examples, (b + 1) * batch_size))]


@torch.no_grad()
def batch_statistics(metric, model: nn.Module, dataset, rank: int = 0, size: int = 1) -> dict[int, object]:
    """``{batch index: statistics}`` of the batches of ``dataset`` that ``rank`` of ``size`` reads."""
    data = dataset
    if size > 1:  # a stream (no length) is read whole by one process: see evaluate
        batches, indices = owned_batches(len(dataset), metric.batch_size, rank, size)
        data = Subset(dataset, indices)
    loader = DataLoader(
        data, metric.batch_size, collate_fn=metric.collate_fn or default_data_collator, **(metric.loader_kwargs or {})
    )
    with evaluating(model) as device:
        stats = [metric.batch_statistics(model, batch, device) for batch in loader]
    return dict(zip(batches if size > 1 else range(len(stats)), stats))


def gathered_statistics(metric, model: nn.Module, dataset, world=None) -> list:
    """The statistics of every batch of ``dataset``, in order, each computed by one of ``world``'s processes."""
    world = world or OneProcess()
    merged: dict[int, object] = {}
    for part in world.all_gather(batch_statistics(metric, model, dataset, world.rank, world.size)):
        merged.update(part)
    return [merged[b] for b in sorted(merged)]


def evaluate(metric, model: nn.Module, dataset, world=None) -> float:
    """``metric`` of ``model`` on ``dataset``, the work shared by ``world``'s processes (every process must call
    it with the same model and data). Without ``world``, or for a metric that cannot be combined, as one process.
    """
    world = world or OneProcess()
    if hasattr(metric, "evaluate_sharded"):  # a metric over metrics (MeanOverSets) shares each of its own
        return metric.evaluate_sharded(model, dataset, world)
    streamed = not hasattr(dataset, "__len__")  # a stream: its batches cannot be dealt out
    if is_batch_metric(metric) and not (streamed and world.size > 1):
        return float(metric.finish(gathered_statistics(metric, model, dataset, world)))
    name = getattr(metric, "name", None) or type(metric).__name__
    if world.is_main and name not in _NOTED and world.size > 1:
        _NOTED.add(name)
        logger.info(
            "[hf-sms] %s is not shared by the processes (not a batch metric, or a stream): the main process "
            "computes it",
            name,
        )
    compute = (
        (lambda: evaluate(metric, model, dataset)) if is_batch_metric(metric) else (lambda: metric(model, dataset))
    )
    if world.size == 1:
        return float(compute())
    return world.all_gather(float(compute()) if world.is_main else None)[0]


def predict_shared(metric, model: nn.Module, dataset, world=None):
    """``metric.predict_targets(model, dataset)`` (probabilities, and what ``score_targets`` compares them with),
    each of ``world``'s processes predicting its batches, gathered in order on every one: the processes that hold a
    replica share the ensemble diagnostic's predictions. A stream is predicted whole by each."""
    world = world or OneProcess()
    if world.size == 1 or not hasattr(dataset, "__len__"):
        return metric.predict_targets(model, dataset)
    _, indices = owned_batches(len(dataset), metric.batch_size, world.rank, world.size)
    mine = metric.predict_targets(model, Subset(dataset, indices)) if indices else None
    return _in_order([(i, part) for i, part in world.all_gather((indices, mine)) if i], len(dataset))


def _in_order(parts: list, n: int):
    """Per-example values of several processes (tensors, lists, tuples of them) put back in dataset order."""
    first = parts[0][1]
    if isinstance(first, tuple):
        return tuple(_in_order([(i, part[j]) for i, part in parts], n) for j in range(len(first)))
    if torch.is_tensor(first):
        out = first.new_empty((n, *first.shape[1:]))
        for indices, part in parts:
            out[torch.as_tensor(indices)] = part
        return out
    out = [None] * n
    for indices, part in parts:
        for i, value in zip(indices, part):
            out[i] = value
    return out


def recalibrate_shared(
    model: nn.Module,
    dataset,
    batch_size: int,
    world=None,
    seed: int = 0,
    max_batches: int | None = None,
    collate_fn=None,
    loader_kwargs: dict | None = None,
) -> nn.Module:
    """BatchNorm recalibration (:func:`hf_sms.recalibrate_batchnorm`) over ``dataset`` in batches of ``batch_size``
    (the first ``max_batches``), the batches dealt out to ``world``'s processes as for evaluation. Each batch is read
    under seeds derived from ``(seed, its first item)`` and run under one derived from ``(seed, its index)``, so random
    augmentation, dropout and stochastic depth draw the same whoever reads and runs it (loader workers or not, CPU or
    GPU), and every process gets the statistics one process computes. A stream is read by the main process alone."""
    world = world or OneProcess()
    data, limit, batches = SeededItems(dataset, seed, batch_size), max_batches, itertools.count()
    if not has_length(dataset):  # a stream: its batches cannot be dealt out
        data = dataset if world.is_main else []
    elif world.size > 1:
        n = len(data) if limit is None else min(len(data), limit * batch_size)
        batches, indices = owned_batches(n, batch_size, world.rank, world.size)
        data, limit = Subset(data, indices), None
    loader = DataLoader(data, batch_size, collate_fn=collate_fn or default_data_collator, **(loader_kwargs or {}))
    seeds = (derive_seed(seed, "batchnorm", b) for b in batches)  # batch b's dropout draws, whoever runs it
    device = next(model.parameters()).device
    with kept_randomness(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # a stream's augmentation stays reproducible
        return recalibrate_batchnorm(model, loader, limit, world, seeds)

"""Named evaluations of a run: which test sets are scored, with which metric (docs/method.md §8).

A run is selected on validation only; it may report any number of test sets, e.g. the clean test set,
corrupted copies of it (OOD accuracy) and a subgroup metric (fairness). A metric is any
``metric(model, dataset) -> float``; one that also has ``details(model, dataset) -> dict`` (per corruption,
per subgroup) gets its details kept in results.json, and the details' ``"value"`` is its score.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from torch import nn

from .metrics import MetricFn, as_metric
from .sharded import evaluate


def _is_metric(obj) -> bool:
    return callable(obj) or as_metric(obj) is not obj


def named_tests(test_dataset, metric_fn: MetricFn) -> dict[str, tuple[object, MetricFn]]:
    """``{name: (dataset, metric)}`` from what a caller passes as ``test_dataset``.

    ``None`` gives no test set; a dataset is ``{"test": (dataset, metric_fn)}``; a mapping names its test
    sets, each either a dataset (scored with ``metric_fn``) or a ``(dataset, metric)`` pair.
    """
    if test_dataset is None:
        return {}
    metric_fn = as_metric(metric_fn)
    if isinstance(test_dataset, tuple) and len(test_dataset) == 2 and _is_metric(test_dataset[1]):
        raise ValueError("test_dataset=(dataset, metric) needs a name: pass test_dataset={'test': (dataset, metric)}")
    if not isinstance(test_dataset, Mapping) or hasattr(test_dataset, "column_names"):  # a datasets.Dataset
        _check_not_empty("test", test_dataset)
        return {"test": (test_dataset, metric_fn)}
    out = {}
    for name, entry in test_dataset.items():
        is_pair = (
            isinstance(entry, tuple) and len(entry) == 2 and (callable(entry[1]) or as_metric(entry[1]) is not entry[1])
        )
        dataset, metric = entry if is_pair else (entry, metric_fn)
        _check_not_empty(name, dataset)
        out[str(name)] = (dataset, as_metric(metric))
    return out


def _check_not_empty(name, dataset) -> None:
    """An empty test set (or an empty mapping of them, e.g. corruptions) could only fail after training."""
    try:
        empty = len(dataset) == 0  # a mapping of data sets too; a stream has no length
    except TypeError:
        empty = False
    if empty:
        raise ValueError(
            f"test set {name!r} is empty (no examples, or a mapping of no data sets); give data or drop it"
        )


def metric_name(metric: MetricFn) -> str:
    """What a metric measures, for tables and model cards ("top-1 accuracy", "BLEU", "mIoU", ...)."""
    return getattr(metric, "name", None) or getattr(metric, "__name__", None) or type(metric).__name__


def measure(metric: MetricFn, model: nn.Module, dataset, world=None) -> tuple[float, dict | None]:
    """``(value, details or None)`` of ``metric`` on ``dataset``, evaluating once; with ``world`` (every process
    calls it with the same model) the processes share the work where the metric allows (see :func:`evaluate`)."""
    if world is not None and hasattr(metric, "sharded_details"):
        details = metric.sharded_details(model, dataset, world)
        return float(details["value"]), details
    if hasattr(metric, "details"):
        details = metric.details(model, dataset)
        return float(details["value"]), details
    return evaluate(metric, model, dataset, world), None


class MeanOverSets:
    """A metric over several datasets: their mean, with every value kept (e.g. OOD accuracy over the 15
    corruptions x 5 severities of CIFAR-100-C / ImageNet-C, Hendrycks & Dietterich 2019).

    ``datasets`` maps a key to a dataset; keys that are ``(corruption, severity)`` pairs also get their
    per-corruption and per-severity means in ``details``.
    """

    def __init__(self, metric: MetricFn, name: str | None = None):
        self.metric = metric
        self.name = name or f"OOD {metric_name(metric)}"

    def details(self, model: nn.Module, datasets: Mapping) -> dict:
        return self.sharded_details(model, datasets, None)

    def sharded_details(self, model: nn.Module, datasets: Mapping, world) -> dict:
        """:meth:`details`, each set's metric shared by ``world``'s processes where it allows."""
        values = {key: evaluate(self.metric, model, d, world) for key, d in datasets.items()}
        out = {"value": statistics.mean(values.values()), "per_set": {_key(k): v for k, v in values.items()}}
        pairs = [k for k in values if isinstance(k, tuple) and len(k) == 2]
        if len(pairs) == len(values):
            for axis, name in ((0, "per_corruption"), (1, "per_severity")):
                groups: dict = {}
                for key, value in values.items():
                    groups.setdefault(_key(key[axis]), []).append(value)
                out[name] = {g: statistics.mean(v) for g, v in groups.items()}
        return out

    def __call__(self, model: nn.Module, datasets: Mapping) -> float:
        return self.details(model, datasets)["value"]


def _key(key) -> str:
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)

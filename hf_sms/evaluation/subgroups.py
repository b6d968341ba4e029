"""Subgroup recall: the paper's fairness evaluation (CelebA, Male/Female x Blond/Non-blond).

A subgroup is a pair (group attribute, true class); its recall is the % of its examples predicted as
their true class. Pruning tends to hurt the rare subgroups (blond men) most, and SMS hurts them less than
IMP, so the worst-group recall is the score: what selection maximises when fairness is the goal.
"""

from __future__ import annotations

import csv
import warnings
from collections.abc import Callable, Hashable, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import default_data_collator

from ..batchnorm import forward_batch
from .metrics import _logits, predict_proba
from .sharded import gathered_statistics


def _plain(value) -> Hashable:
    """A group or class value as a plain Python scalar (tensors and numpy scalars are not usable as keys)."""
    return value.item() if hasattr(value, "item") else value


class _SplitGroups:
    """A collate function that takes the group attribute out of every item before the inner collate.

    The model never sees the group (its forward does not take it), and the inner collate never has to
    handle it (``default_data_collator`` silently drops string values). The groups of every batch are
    appended to ``groups`` in loader order, so one pass over the data gives predictions and groups.
    """

    def __init__(self, key: str, inner: Callable):
        self.key, self.inner, self.groups = key, inner, []

    def __call__(self, items: list) -> dict:
        if not all(isinstance(item, Mapping) and self.key in item for item in items):
            raise ValueError(f"subgroup metrics need dict items with a {self.key!r} key (the group attribute)")
        self.groups += [_plain(item[self.key]) for item in items]
        return self.inner([{k: v for k, v in item.items() if k != self.key} for item in items])


class _KeepGroups(_SplitGroups):
    """A collate function giving ``(groups, batch)``: the groups travel with their batch (loader workers too)."""

    def __call__(self, items: list) -> tuple[list, dict]:
        batch = super().__call__(items)
        groups, self.groups = self.groups, []
        return groups, batch


def subgroup_recall(
    predicted: torch.Tensor, labels: torch.Tensor, groups: list, group_names=None, class_names=None, group_key="group"
) -> dict:
    """Recall of every (group, true class) subgroup present in the data.

    Args:
        predicted: predicted class per example, shape ``(N,)``.
        labels: true class per example, shape ``(N,)``.
        groups: group attribute per example (any hashable values), length ``N``.
        group_names, class_names: optional readable names of group and class values.
        group_key: the group attribute's name, used in default subgroup names (``"group=1,class=0"``).

    Returns:
        ``{"value", "worst_group_recall", "worst_group", "mean_recall", "per_group", "counts"}``, recalls
        in %; ``value`` is the worst-group recall (the score the SMS loop records).
    """
    if not (len(predicted) == len(labels) == len(groups)):
        raise ValueError(f"{len(predicted)} predictions, {len(labels)} labels and {len(groups)} groups differ")
    hits: dict[tuple, list[int]] = {}
    for p, y, g in zip(predicted.tolist(), labels.tolist(), groups, strict=True):
        hits.setdefault((g, y), []).append(int(p == y))
    try:
        keys = sorted(hits)
    except TypeError:  # group values of mixed types do not sort; first-seen order is still deterministic
        keys = list(hits)
    group_names, class_names = group_names or {}, class_names or {}

    def name(g, y) -> str:
        group = group_names[g] if g in group_names else f"{group_key}={g}"
        return f"{group},{class_names[y] if y in class_names else f'class={y}'}"

    per_group = {name(*k): 100.0 * sum(hits[k]) / len(hits[k]) for k in keys}
    if not per_group:
        raise ValueError("no examples to compute subgroup recall on")
    # Every (group, class) pair of the groups and classes the data or the names know is a subgroup; one without
    # test items has no recall, and the worst group may be exactly that one (the rarest group is the point).
    all_groups = list(dict.fromkeys([g for g, _ in keys] + list(group_names)))
    all_classes = list(dict.fromkeys([y for _, y in keys] + list(class_names)))
    missing = [name(g, y) for g in all_groups for y in all_classes if (g, y) not in hits]
    worst = min(per_group, key=per_group.get)
    mean = sum(per_group.values()) / len(per_group)
    if missing:
        warnings.warn(
            f"subgroups {missing} have no test items: the worst-group recall is over the others only and may "
            "miss the worst group; add test items of every subgroup",
            stacklevel=2,
        )
    return {
        "value": per_group[worst],
        "balanced_accuracy": mean,  # the mean recall over subgroups
        "worst_group_recall": per_group[worst],
        "worst_group": worst if not missing else f"{worst} (of those with test items; missing: {', '.join(missing)})",
        "missing": missing,
        "mean_recall": mean,
        "per_group": {**per_group, **dict.fromkeys(missing)},
        "counts": {**{name(*k): len(hits[k]) for k in keys}, **dict.fromkeys(missing, 0)},
    }


class SubgroupRecall:
    """Worst-group recall in % as a metric for the SMS loop: ``metric(model, dataset) -> float``.

    Items are dicts with ``labels`` (the class) and a group attribute under ``group_key``; the attribute is
    removed before the forward pass. ``details`` gives every subgroup's recall, and ``predict`` / ``score``
    let the loop score the replicas' prediction ensemble, as :class:`~hf_sms.evaluation.metrics.ClassificationAccuracy`.

    Args:
        group_key: the item key of the group attribute (e.g. ``"group"``: 0 non-blond, 1 blond).
        batch_size: evaluation batch size (default: a run's ``per_device_eval_batch_size``, else 256).
        collate_fn: the collate of the remaining keys; ``default_data_collator`` by default.
        group_names: readable names of group values, e.g. ``{0: "female", 1: "male"}``.
        class_names: readable names of classes, e.g. ``{0: "female", 1: "male"}``.
        score: ``"worst"``: the worst-group recall is the metric's value; ``"balanced"``: the mean recall over the
            subgroups (balanced accuracy, the paper's CelebA table).
    """

    def __init__(
        self,
        group_key: str = "group",
        batch_size: int | None = None,
        collate_fn=None,
        group_names: dict | None = None,
        class_names: dict | None = None,
        score: str = "worst",
    ):
        if score not in ("worst", "balanced"):
            raise ValueError(f"score={score!r}: choose 'worst' (worst-group recall) or 'balanced' (mean recall)")
        self.group_key, self.inner_collate = group_key, collate_fn or default_data_collator
        self.batch_size, self.batch_size_open = batch_size or 256, batch_size is None  # open: the run's eval size
        self.collate_fn = _KeepGroups(group_key, self.inner_collate)  # batches of (groups, batch): a batch metric
        self.loader_kwargs: dict = {}
        self.group_names, self.class_names, self.score_name = group_names, class_names, score
        self.name = "worst-group recall" if score == "worst" else "balanced accuracy"
        self._last: tuple | None = None  # (dataset, labels, groups) of the last pass: score() reads the data once

    def _predict(self, model: nn.Module, dataset) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Probabilities, labels and groups in one pass over ``dataset``."""
        collate = _SplitGroups(self.group_key, self.inner_collate)
        # no loader workers: the groups are collected by the collate function, which workers would run elsewhere
        probs, labels = predict_proba(model, dataset, self.batch_size, collate)
        self._last = (dataset, labels, collate.groups)
        return probs, labels, collate.groups

    def _labels_and_groups(self, dataset) -> tuple[torch.Tensor, list]:
        if self._last is not None and self._last[0] is dataset:
            return self._last[1], self._last[2]
        collate = _SplitGroups(self.group_key, self.inner_collate)
        labels = torch.cat([batch["labels"] for batch in DataLoader(dataset, self.batch_size, collate_fn=collate)])
        return labels, collate.groups

    def _summary(self, predicted: torch.Tensor, labels: torch.Tensor, groups: list) -> dict:
        result = subgroup_recall(predicted, labels, groups, self.group_names, self.class_names, self.group_key)
        if self.score_name == "balanced":
            result["value"] = result["balanced_accuracy"]
        return result

    def batch_statistics(self, model: nn.Module, batch: tuple, device) -> tuple[list, list, list]:
        groups, inputs = batch
        predicted = _logits(forward_batch(model, inputs, device)).argmax(-1).cpu()
        return predicted.tolist(), inputs["labels"].tolist(), groups

    def finish(self, statistics: list[tuple[list, list, list]]) -> float:
        return self._finish(statistics)["value"]

    def _finish(self, statistics: list) -> dict:
        predicted, labels, groups = ([x for s in statistics for x in s[k]] for k in range(3))
        return self._summary(torch.tensor(predicted), torch.tensor(labels), groups)

    def details(self, model: nn.Module, dataset) -> dict:
        """Per-subgroup recalls, their mean and the worst one (see :func:`subgroup_recall`)."""
        return self.sharded_details(model, dataset, None)

    def sharded_details(self, model: nn.Module, dataset, world) -> dict:
        """:meth:`details`, the batches shared by ``world``'s processes (exact: predicted classes are gathered)."""
        return self._finish(gathered_statistics(self, model, dataset, world))

    def predict(self, model: nn.Module, dataset) -> torch.Tensor:
        """Class probabilities ``(N, C)``, for the prediction-ensemble diagnostic."""
        return self._predict(model, dataset)[0]

    def predict_targets(self, model: nn.Module, dataset) -> tuple[torch.Tensor, tuple[torch.Tensor, list]]:
        """``(probabilities, (labels, groups))``, what :meth:`score_targets` takes."""
        probs, labels, groups = self._predict(model, dataset)
        return probs, (labels, groups)

    def score_targets(self, probs: torch.Tensor, targets: tuple[torch.Tensor, list]) -> float:
        return self._summary(probs.argmax(-1), *targets)["value"]

    def score(self, probs: torch.Tensor, dataset) -> float:
        """The score (worst-group recall, or balanced accuracy) of given probabilities (e.g. the replicas' mean)."""
        return self._summary(probs.argmax(-1), *self._labels_and_groups(dataset))["value"]

    def __call__(self, model: nn.Module, dataset) -> float:
        return self.details(model, dataset)["value"]


# -- CelebA -------------------------------------------------------------------------------------------

# The paper's fairness table (appendix): gender predicted, recall per Male x Blond_Hair subgroup (MB, MN, FB, FN).
CELEBA_NAMES = {"group_names": {0: "non-blond", 1: "blond"}, "class_names": {0: "female", 1: "male"}}


def binary_attribute(value) -> int:
    """A CelebA attribute as 0/1, whichever way it is stored: -1/1 (the original files), 0/1, or a boolean.

    Args:
        value: a bool, a number, a string of one (``"-1"``, ``"1"``, ``"True"``), a tensor or numpy scalar.

    Returns:
        1 if the attribute is present, else 0.
    """
    value = _plain(value)
    if isinstance(value, str):  # CSV cells, or booleans written out as text
        value = {"true": 1, "false": 0, "1": 1, "0": 0, "-1": -1}.get(value.strip().lower(), value)
    if isinstance(value, str) or value not in (-1, 0, 1):  # True == 1 and False == 0, so booleans pass
        raise ValueError(f"a CelebA attribute is -1/1, 0/1 or a boolean, got {value!r}")
    return int(value == 1)


def celeba_gender_by_blond(example: Mapping) -> dict:
    """``{"labels": Male, "group": Blond_Hair}`` (both 0/1) of a CelebA example with attribute columns: the paper's
    setting (its dense row, blond-male recall 94.41 at 98.99% accuracy, is a gender classifier per hair colour).

    Fits ``datasets.Dataset.map``, which keeps the other columns (the image).

    Args:
        example: a row with ``Blond_Hair`` and ``Male`` columns (-1/1, 0/1 or booleans).

    Returns:
        The class (1 male) and the group (1 blond).
    """
    return {"labels": binary_attribute(example["Male"]), "group": binary_attribute(example["Blond_Hair"])}


def celeba_blond_by_gender(example: Mapping) -> dict:
    """The other CelebA setting: ``{"labels": Blond_Hair, "group": Male}`` (blond hair predicted per gender)."""
    return {"labels": binary_attribute(example["Blond_Hair"]), "group": binary_attribute(example["Male"])}


def read_celeba_attributes(csv_path: str, setting=celeba_gender_by_blond) -> dict[str, dict]:
    """The labels and groups of every image in CelebA's ``list_attr_celeba.csv``.

    Args:
        csv_path: the CSV with an ``image_id`` column and the 40 attribute columns (-1/1).
        setting: :func:`celeba_gender_by_blond` (the paper's, default) or :func:`celeba_blond_by_gender`.

    Returns:
        ``{image_id: {"labels": ..., "group": ...}}`` with 0/1 values.
    """
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"image_id", "Blond_Hair", "Male"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{csv_path} lacks the columns {sorted(missing)}; expected list_attr_celeba.csv")
        return {row["image_id"]: setting(row) for row in reader}

"""Pruning criteria: what each weight is worth (docs/method.md §2, §11). One file each, registering a function in
``CRITERIA``: a new file here registers by being here (no import line, no list to edit).

A criterion is a pure function ``(tensors, weights, context) -> {name: scores}``: one score per weight, higher is
kept. ``weights`` are detached float32 copies with pruned entries zeroed. A structure sums the scores of a unit's
weights, so ``"l2"`` ranks units by their L2 norm and ``"l1"`` by their L1 norm; an allocation ranks weights or
units by them.

The contract every criterion keeps: the same model, masks and context give the same scores, bit for bit. The loop
computes masks again and relies on that (every process of a distributed run, a resumed phase, a re-pruned soup),
so randomness comes from ``context.seed`` and activations from ``context.example_inputs``, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...registry import CRITERIA, import_submodules
from ..prunable import PrunableTensor

register_criterion = CRITERIA.register


@dataclass(frozen=True)
class CriterionContext:
    """What a criterion may read besides the weights: the model, a batch of inputs (one batch of the run, as its
    data collator makes it: a dict such as ``{"x": ..., "labels": ...}``, a tuple or a tensor), and a seed."""

    model: nn.Module
    example_inputs: object = None
    seed: int = 0


Criterion = Callable[[list[PrunableTensor], dict[str, torch.Tensor], CriterionContext], dict[str, torch.Tensor]]


def criterion_scores(name: str, tensors, weights, context: CriterionContext) -> dict[str, torch.Tensor]:
    """The scores of the criterion ``name`` (a ``ValueError`` names the choices for an unknown one)."""
    return CRITERIA.get(name)(tensors, weights, context)


import_submodules(__name__, __path__)  # every file registers its criterion

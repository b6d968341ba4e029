"""The magnitude criteria: ``|w|`` (the paper's, and Li et al.'s L1 filter norm) and ``w**2`` (the L2 norm).

A filter is scored by its own kernel(s), the layer(s) producing it, as Li et al. (2017) and the paper do; the
``*_group`` criteria score it by every weight it touches (its producers and the slices of every layer that reads
it), an alternative the paper did not use. Neurons and heads are scored by all their weights either way
(docs/method.md §11)."""

from __future__ import annotations

import torch

from ..top_k import ElementwiseScores
from . import register_criterion


@register_criterion("magnitude")
def magnitude(tensors, weights, context):
    """``|w|`` (the paper's criterion); a unit's score is its L1 norm."""
    return ElementwiseScores(weights, torch.abs)  # each computed when needed: a global top-k never holds them all


@register_criterion("l1")
def l1(tensors, weights, context):
    """``|w|``: a unit's score is its L1 norm (Li et al. 2017's own filter criterion)."""
    return magnitude(tensors, weights, context)


@register_criterion("l2")
def l2(tensors, weights, context):
    """``w**2``: a unit's score is its squared L2 norm, which ranks units as the norm does (docs/method.md §11);
    the default for units (the paper: "we adopt the L2-norm criterion from Li et al.")."""
    return ElementwiseScores(weights, torch.square)


@register_criterion("l2_group", unit_score="group")
def l2_group(tensors, weights, context):
    """``w**2`` over every weight of a unit: a filter's producers and the slices of the layers that read it."""
    return l2(tensors, weights, context)


@register_criterion("l1_group", unit_score="group")
def l1_group(tensors, weights, context):
    """``|w|`` over every weight of a unit: a filter's producers and the slices of the layers that read it."""
    return magnitude(tensors, weights, context)

"""Pruning: which weights are prunable (``prunable``), what each is worth (``criteria``), which fall together
(``structures``), how a sparsity is spread over them (``allocations``), masks and phase targets (``masks``), cutting
removed units out (``shrink``, ``structured`` for conv filters, ``fit_config`` for the widths a family's config can
state), and keeping pruned weights at zero while training
(``enforcement``)."""

from .allocations import get_allocation, n_of_m
from .criteria import CriterionContext
from .enforcement import ExactMasking, MaskEnforcer, MaskingPolicy, keeps_zeros
from .masks import (
    Pruning,
    PruningStep,
    apply_masks,
    compute_masks,
    masks_from_model,
    phase_sparsities,
    prune,
    resolve_pruning,
    sparsity_report,
    validate_masks,
)
from .prunable import Masks, PrunableTensor, prunable_tensors
from .shrink import shrink
from .structures import Member, UnitGroup, unit_groups

__all__ = [
    "CriterionContext",
    "ExactMasking",
    "MaskEnforcer",
    "MaskingPolicy",
    "Masks",
    "Member",
    "PrunableTensor",
    "Pruning",
    "PruningStep",
    "UnitGroup",
    "apply_masks",
    "compute_masks",
    "get_allocation",
    "keeps_zeros",
    "masks_from_model",
    "n_of_m",
    "phase_sparsities",
    "prunable_tensors",
    "prune",
    "resolve_pruning",
    "shrink",
    "sparsity_report",
    "unit_groups",
    "validate_masks",
]

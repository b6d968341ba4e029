"""Pruning: which weights are prunable (``prunable``), how a sparsity is spread over them (``allocations``), masks
and phase targets (``masks``), whole filters (``structured``), and keeping pruned weights at zero while training
(``enforcement``)."""

from .allocations import get_allocation, n_of_m
from .enforcement import ExactMasking, MaskEnforcer, MaskingPolicy, keeps_zeros
from .masks import (
    PruningStep,
    apply_masks,
    compute_masks,
    masks_from_model,
    phase_sparsities,
    prune,
    sparsity_report,
    validate_masks,
)
from .prunable import Masks, PrunableTensor, prunable_tensors

__all__ = [
    "ExactMasking",
    "MaskEnforcer",
    "MaskingPolicy",
    "Masks",
    "PrunableTensor",
    "PruningStep",
    "apply_masks",
    "compute_masks",
    "get_allocation",
    "keeps_zeros",
    "masks_from_model",
    "n_of_m",
    "phase_sparsities",
    "prunable_tensors",
    "prune",
    "sparsity_report",
    "validate_masks",
]

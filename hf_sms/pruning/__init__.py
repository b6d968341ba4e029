"""Pruning mechanics: which weights are prunable (``prunable``), what each is worth (``criteria``), how a sparsity is
spread over them (``allocations``), which slices form whole units (``graph`` traces them, ``units`` masks them),
masks and phase targets (``masks``), and keeping pruned weights at zero while training (``enforcement``). Which of
these a run uses is its plan's (:mod:`hf_sms.plan`)."""

from .allocations import get_allocation, n_of_m
from .criteria import CriterionContext
from .enforcement import ExactMasking, MaskEnforcer, MaskingPolicy, keeps_zeros
from .graph import trace_units
from .masks import (
    PruningStep,
    apply_masks,
    masks_from_model,
    phase_sparsities,
    sparsity_report,
    validate_masks,
)
from .prunable import Masks, PrunableTensor, prunable_tensors
from .units import Member, UnitGroup, removed_units, unit_masks, unit_report

__all__ = [
    "CriterionContext",
    "ExactMasking",
    "MaskEnforcer",
    "MaskingPolicy",
    "Masks",
    "Member",
    "PrunableTensor",
    "PruningStep",
    "UnitGroup",
    "apply_masks",
    "get_allocation",
    "keeps_zeros",
    "masks_from_model",
    "n_of_m",
    "phase_sparsities",
    "prunable_tensors",
    "removed_units",
    "sparsity_report",
    "trace_units",
    "unit_masks",
    "unit_report",
    "validate_masks",
]

"""Pruning during training (GMP, DPF, BIMP), each +SMS: one file per method, registered in
:data:`hf_sms.registry.PRUNING_METHODS` with the check its config must pass. ``pruning_method="imp"`` (the
default) is the SMS loop itself."""

from ..registry import import_submodules
from .common import MethodContext
from .dpf import DynamicPruning, FeedbackMasking
from .gmp import GradualPruning, gmp_phases, gmp_sparsity, pruning_iterations, pruning_targets, sparsity_at

__all__ = [
    "DynamicPruning",
    "FeedbackMasking",
    "GradualPruning",
    "MethodContext",
    "gmp_phases",
    "gmp_sparsity",
    "pruning_iterations",
    "pruning_targets",
    "sparsity_at",
]

import_submodules(__name__, __path__)  # every file registers its entries: a new one needs no import line

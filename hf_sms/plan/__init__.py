"""The pruning choice resolved once (docs/method.md §2, §11): a :class:`PruningPlan` of criterion x structure x
allocation, whose structure object the run asks what to mask, refuse, report, save and time."""

from .plan import PruningPlan, compute_masks, prune, resolve_pruning
from .structures import Final, NOfM, Structure, Units, Unstructured, get_structure

__all__ = [
    "Final",
    "NOfM",
    "PruningPlan",
    "Structure",
    "Units",
    "Unstructured",
    "compute_masks",
    "get_structure",
    "prune",
    "resolve_pruning",
]

"""hf-sms: Sparse Model Soups (Zimmer, Spiegel, Pokutta; ICLR 2024) for the Hugging Face ecosystem."""

from .batchnorm import recalibrate_batchnorm
from .config import SparseSoupConfig
from .hub import push_to_hub
from .merge import MERGE_METHODS, greedy_soup, uniform_soup
from .pruning import (
    ALLOCATIONS,
    PruningStep,
    apply_masks,
    compute_masks,
    phase_sparsities,
    prunable_tensors,
    prune,
    sparsity_report,
)
from .schedules import RETRAIN_SCHEDULES
from .sms import SparseModelSoup, run_sms
from .sparse_format import load_sparse, save_sparse
from .trainer import SparseSoupTrainer

__version__ = "0.1.0"
__all__ = [
    "ALLOCATIONS",
    "MERGE_METHODS",
    "RETRAIN_SCHEDULES",
    "PruningStep",
    "SparseModelSoup",
    "SparseSoupConfig",
    "SparseSoupTrainer",
    "apply_masks",
    "compute_masks",
    "greedy_soup",
    "load_sparse",
    "phase_sparsities",
    "prunable_tensors",
    "prune",
    "push_to_hub",
    "recalibrate_batchnorm",
    "run_sms",
    "save_sparse",
    "sparsity_report",
    "uniform_soup",
]

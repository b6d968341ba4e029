"""hf-sms: Sparse Model Soups (Zimmer, Spiegel, Pokutta; ICLR 2024) for the Hugging Face ecosystem."""

from . import baselines, methods, soup  # noqa: F401  (registering every soup, method and baseline)
from .arguments import SparseSoupSeq2SeqConfig, sparse_config
from .batchnorm import recalibrate_batchnorm
from .checkpoint import load_sparse, save_sparse, transformers_integration
from .checkpoint.families import register_family
from .config import SparseSoupArguments, SparseSoupConfig
from .hub import push_to_hub
from .loop.sms import SparseModelSoup, run_sms
from .methods.common import MethodContext
from .phase import PhaseSpec
from .plan import PruningPlan, compute_masks, prune, resolve_pruning
from .pruning import (
    CriterionContext,
    PruningStep,
    UnitGroup,
    apply_masks,
    phase_sparsities,
    prunable_tensors,
    sparsity_report,
)
from .registry import (
    ALLOCATIONS,
    BASELINES,
    CRITERIA,
    PRUNING_METHODS,
    RETRAIN_SCHEDULES,
    SOUPS,
    STRUCTURES,
    Registry,
)
from .runtime import to_sparse_runtime
from .shrink import shrink
from .soup import greedy_soup, uniform_soup
from .soup.method import SoupMethod
from .trainer import SparseSoupMixin, SparseSoupSeq2SeqTrainer, SparseSoupTrainer

transformers_integration.register()  # AutoModel*.from_pretrained(dir) decodes bitmask checkpoints

__version__ = "0.1.0"
__all__ = [
    "ALLOCATIONS",
    "BASELINES",
    "CRITERIA",
    "PRUNING_METHODS",
    "RETRAIN_SCHEDULES",
    "SOUPS",
    "STRUCTURES",
    "CriterionContext",
    "MethodContext",
    "PhaseSpec",
    "PruningPlan",
    "PruningStep",
    "Registry",
    "SoupMethod",
    "SparseModelSoup",
    "SparseSoupArguments",
    "SparseSoupConfig",
    "SparseSoupMixin",
    "SparseSoupSeq2SeqConfig",
    "SparseSoupSeq2SeqTrainer",
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
    "register_family",
    "resolve_pruning",
    "shrink",
    "sparse_config",
    "sparsity_report",
    "to_sparse_runtime",
    "UnitGroup",
    "uniform_soup",
]

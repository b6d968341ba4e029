"""hf-sms: Sparse Model Soups (Zimmer, Spiegel, Pokutta; ICLR 2024) for the Hugging Face ecosystem.

Every public name is imported when first used (:mod:`hf_sms.lazy`): ``import hf_sms`` costs no torch import, and
``AutoModel*.from_pretrained(dir)`` decodes bitmask checkpoints (registered when transformers' models load).
"""

import importlib

from .lazy import lazy_exports, when_imported

_EXPORTS = {
    "merge_adapters": ".adapters.merge",
    "load_adapter": ".adapters.folders",
    "SparseSoupSeq2SeqConfig": ".training.arguments",
    "sparse_config": ".training.arguments",
    "recalibrate_batchnorm": ".batchnorm",
    "load_sparse": ".checkpoint.sparse",
    "save_sparse": ".checkpoint.sparse",
    "register_family": ".families",
    "SparseSoupArguments": ".training.config",
    "SparseSoupConfig": ".training.config",
    "push_to_hub": ".records.hub",
    "SparseModelSoup": ".loop.sms",
    "run_sms": ".loop.sms",
    "MethodContext": ".methods.common",
    "PhaseSpec": ".training.phase",
    "PruningPlan": ".plan.plan",
    "compute_masks": ".plan.plan",
    "prune": ".plan.plan",
    "resolve_pruning": ".plan.plan",
    "CriterionContext": ".pruning.criteria",
    "PruningStep": ".pruning.masks",
    "apply_masks": ".pruning.masks",
    "phase_sparsities": ".pruning.masks",
    "sparsity_report": ".pruning.masks",
    "prunable_tensors": ".pruning.prunable",
    "UnitGroup": ".pruning.units",
    "ALLOCATIONS": ".registry",
    "BASELINES": ".registry",
    "CRITERIA": ".registry",
    "PRUNING_METHODS": ".registry",
    "REPLICA_PARAMS": ".registry",
    "RETRAIN_SCHEDULES": ".registry",
    "SOUPS": ".registry",
    "STRUCTURES": ".registry",
    "Registry": ".registry",
    "to_sparse_runtime": ".runtime.convert",
    "shrink": ".shrinking.shrink",
    "greedy_soup": ".soup.merging",
    "uniform_soup": ".soup.merging",
    "SoupMethod": ".soup.method",
    "SparseSoupMixin": ".training.trainer",
    "SparseSoupSeq2SeqTrainer": ".training.trainer",
    "SparseSoupTrainer": ".training.trainer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def _register_with_transformers() -> None:
    integration = importlib.import_module(".checkpoint.transformers_integration", __name__)
    if hasattr(integration, "register"):  # else it is being imported right now, and registers at its end
        integration.register()


# AutoModel*.from_pretrained(dir) decodes bitmask checkpoints: registered once the module that defines
# from_pretrained has loaded (with it transformers' quantizers), not before, so importing hf_sms imports neither
# torch nor transformers.
when_imported("transformers.modeling_utils", _register_with_transformers)

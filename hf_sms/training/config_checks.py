"""The plain checks of a :class:`~hf_sms.training.config.SparseSoupArguments`: lengths of per-replica lists, ranges, and
settings that need each other; each error says how to fix it, before any work is done."""

from __future__ import annotations

from ..registry import PRUNING_METHODS

# The trainer's learning-rate modes (see SparseSoupTrainer's ``lr_schedule``).
LR_SCHEDULES = ("retrain", "original", "pretrain")


def check_lengths_and_ranges(a) -> None:
    """Raise ``ValueError`` naming the field and the fix where ``a`` (a SparseSoupArguments) is inconsistent."""
    if a.pretrain_epochs is not None and not a.pretrain_epochs > 0:
        raise ValueError(f"pretrain_epochs is the original training's length and must be > 0, got {a.pretrain_epochs}")
    if a.replicas_per_phase is not None and (
        len(a.replicas_per_phase) != a.n_phases or not all(1 <= m <= a.num_replicas for m in a.replicas_per_phase)
    ):
        raise ValueError(
            f"replicas_per_phase={a.replicas_per_phase} needs one m per phase (n_phases={a.n_phases}), "
            f"each between 1 and num_replicas={a.num_replicas}"
        )
    for name in ("replica_seeds", "replica_weight_decays", "replica_learning_rates", "replica_epochs"):
        values = getattr(a, name)
        if values is not None and len(values) != a.num_replicas:
            raise ValueError(
                f"{name} has {len(values)} entries but num_replicas={a.num_replicas}; give one per replica"
            )
    if a.replica_epochs is not None and a.max_steps > 0:
        raise ValueError(
            "replica_epochs varies the retraining length in epochs, but max_steps > 0 fixes it in steps; "
            "set max_steps=-1 (the default) or drop replica_epochs"
        )
    if a.bn_recalibration_batches is not None and (
        isinstance(a.bn_recalibration_batches, bool)
        or not isinstance(a.bn_recalibration_batches, int)
        or a.bn_recalibration_batches < 1
    ):
        raise ValueError(
            f"bn_recalibration_batches={a.bn_recalibration_batches!r} must be a positive number of batches "
            "(None: the whole training set); recalibrate_bn=False skips the recalibration"
        )
    if a.resume not in ("auto", "force"):
        raise ValueError(f"resume={a.resume!r} is unknown; choose 'auto' or 'force'")
    if a.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={a.lr_schedule!r} is unknown; choose one of {LR_SCHEDULES}")
    if not 0.0 <= a.retrain_warmup_fraction < 1.0:
        raise ValueError(f"retrain_warmup_fraction must be in [0, 1), got {a.retrain_warmup_fraction}")
    if not 0.0 < a.validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {a.validation_fraction}")
    method = PRUNING_METHODS.meta(a.pruning_method)  # {} for "imp", the loop itself
    known_length = a.pretrain_epochs or method.get("original_length", lambda config: None)(a)
    if a.retrain_schedule in ("lrw", "slr", "allr") and not known_length:
        raise ValueError(
            f"retrain_schedule={a.retrain_schedule!r} needs the original training's length: set "
            "pretrain_epochs (e.g. --pretrain_epochs 90), or use retrain_schedule='llr'"
        )
    if a.retrain_schedule == "ft" and a.eta_min <= 0:
        raise ValueError("retrain_schedule='ft' trains at eta_min, which is 0 here: set pretrain_min_learning_rate")
    if a.replica_sharding not in ("none", "fsdp"):
        raise ValueError(f"replica_sharding={a.replica_sharding!r} is unknown; choose 'none' or 'fsdp'")
    if a.replica_sharding == "fsdp" and (a.replica_params != "all" or a.pruning_method != "imp"):
        raise ValueError(
            "replica_sharding='fsdp' shards full replicas of IMP phases; adapter and bias_norm replicas are small "
            "already, and GMP/DPF/BIMP prune inside training: use replica_params='all' and pruning_method='imp', "
            "or replica_sharding='none'"
        )

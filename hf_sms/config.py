"""``SparseSoupConfig``: TrainingArguments plus what pruning, retraining and the soup need."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy

from .pruning import ALLOCATIONS, phase_sparsities
from .schedules import PRETRAIN_SHAPES, RETRAIN_SCHEDULES

BASELINES = ("imp", "imp_mx", "imp_reprune")


@dataclass(kw_only=True)
class SparseSoupConfig(TrainingArguments):
    r"""Configuration of a Sparse Model Soups run; every TrainingArguments field applies to each replica.

    Parameters that control pruning:
        target_sparsity, n_phases, allocation.
    Parameters that control retraining (METHOD.md §3):
        retrain_schedule, pretrain_learning_rate, pretrain_min_learning_rate, pretrain_schedule,
        pretrain_epochs. ``num_train_epochs`` / ``max_steps`` set the retraining length R per phase.
        ``lr_scheduler_type`` and ``warmup_steps`` are ignored: the retraining schedule owns the LR.
    Parameters that control the soup:
        num_replicas, replicas_per_phase, replica_seeds, replica_weight_decays, replica_learning_rates, replica_epochs,
        merge_method, greedy_keep_ties, recalibrate_bn, validation_fraction, baselines.

    Defaults changed from TrainingArguments: ``save_strategy="no"`` (the SMS loop checkpoints finished
    replicas itself), ``logging_steps=50``.
    """

    # Pruning
    target_sparsity: float = field(default=0.9, metadata={"help": "Goal sparsity after the last phase, in [0, 1)."})
    n_phases: int = field(default=3, metadata={"help": "Number of prune-retrain(-merge) phases."})
    allocation: str = field(
        default="global",
        metadata={"help": f"How sparsity is spread over layers: one of {sorted(ALLOCATIONS)}."},
    )
    # Retraining
    retrain_schedule: str = field(
        default="llr", metadata={"help": f"Retraining LR schedule: one of {sorted(RETRAIN_SCHEDULES)}."}
    )
    pretrain_learning_rate: float | None = field(
        default=None, metadata={"help": "Peak LR eta_max of the original training (default: learning_rate)."}
    )
    pretrain_min_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Smallest LR eta_min of the original training after warm-up (FT, CLR); default: the "
            "final rate of pretrain_schedule."
        },
    )
    pretrain_schedule: str = field(
        default="linear", metadata={"help": f"Shape of the original LR schedule: one of {sorted(PRETRAIN_SHAPES)}."}
    )
    pretrain_epochs: float | None = field(
        default=None, metadata={"help": "Length T of the original training in epochs (needed by LRW, SLR, ALLR)."}
    )
    # Soup
    num_replicas: int = field(default=3, metadata={"help": "Replicas m retrained per phase and merged."})
    replicas_per_phase: list[int] | None = field(
        default=None,
        metadata={"help": "m for each phase, each <= num_replicas (replica i uses the i-th entry of the lists)."},
    )
    replica_seeds: list[int] | None = field(
        default=None, metadata={"help": "Seed of each replica (default: seed + i)."}
    )
    replica_weight_decays: list[float] | None = field(
        default=None, metadata={"help": "Weight decay of each replica (default: weight_decay for all)."}
    )
    replica_learning_rates: list[float] | None = field(
        default=None, metadata={"help": "Initial (peak) retraining LR of each replica (default: learning_rate)."}
    )
    replica_epochs: list[float] | None = field(
        default=None, metadata={"help": "Retraining epochs of each replica (default: num_train_epochs)."}
    )
    merge_method: str = field(default="uniform", metadata={"help": "How replicas are merged: uniform or greedy."})
    greedy_keep_ties: bool = field(
        default=False, metadata={"help": "Greedy soup keeps a candidate that ties the metric (the SMS code's >=)."}
    )
    recalibrate_bn: bool = field(
        default=True, metadata={"help": "Recompute BatchNorm statistics on the training data after each merge."}
    )
    bn_recalibration_batches: int | None = field(
        default=None, metadata={"help": "Batches used for BatchNorm recalibration (default: the whole train set)."}
    )
    validation_fraction: float = field(
        default=0.1, metadata={"help": "Fraction of train split off (fixed seed) for validation when none is given."}
    )
    baselines: list[str] = field(
        default_factory=list, metadata={"help": f"Baselines run beside SMS: any of {list(BASELINES)}."}
    )

    # Changed TrainingArguments defaults.
    save_strategy: SaveStrategy | str = field(
        default="no", metadata={"help": "Checkpoint strategy inside one replica's training."}
    )
    logging_steps: float = field(default=50, metadata={"help": "Log every X updates steps."})

    def __post_init__(self):
        super().__post_init__()
        from .merge import MERGE_METHODS  # merge imports the trainer, which imports this module

        phase_sparsities(self.target_sparsity, self.n_phases)  # raises ValueError on bad input
        choices = {
            "allocation": (self.allocation, ALLOCATIONS),
            "retrain_schedule": (self.retrain_schedule, RETRAIN_SCHEDULES),
            "pretrain_schedule": (self.pretrain_schedule, PRETRAIN_SHAPES),
            "merge_method": (self.merge_method, MERGE_METHODS),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is unknown; choose one of {sorted(allowed)}")
        unknown = sorted(set(self.baselines) - set(BASELINES))
        if unknown:
            raise ValueError(f"baselines {unknown} are unknown; choose from {list(BASELINES)}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.replicas_per_phase is not None and (
            len(self.replicas_per_phase) != self.n_phases
            or not all(1 <= m <= self.num_replicas for m in self.replicas_per_phase)
        ):
            raise ValueError(
                f"replicas_per_phase={self.replicas_per_phase} needs one m per phase (n_phases={self.n_phases}), "
                f"each between 1 and num_replicas={self.num_replicas}"
            )
        for name in ("replica_seeds", "replica_weight_decays", "replica_learning_rates", "replica_epochs"):
            values = getattr(self, name)
            if values is not None and len(values) != self.num_replicas:
                raise ValueError(
                    f"{name} has {len(values)} entries but num_replicas={self.num_replicas}; give one per replica"
                )
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        if self.retrain_schedule in ("lrw", "slr", "allr") and not self.pretrain_epochs:
            raise ValueError(
                f"retrain_schedule={self.retrain_schedule!r} needs the original training's length: set "
                "pretrain_epochs (e.g. --pretrain_epochs 90), or use retrain_schedule='llr'"
            )
        if self.retrain_schedule == "ft" and self.eta_min <= 0:
            raise ValueError("retrain_schedule='ft' trains at eta_min, which is 0 here: set pretrain_min_learning_rate")

    @property
    def eta_max(self) -> float:
        return self.pretrain_learning_rate if self.pretrain_learning_rate is not None else self.learning_rate

    @property
    def eta_min(self) -> float:
        if self.pretrain_min_learning_rate is not None:
            return self.pretrain_min_learning_rate
        return PRETRAIN_SHAPES[self.pretrain_schedule](1.0, self.eta_max, 0.0)

    def phase_replicas(self, phase: int) -> int:
        """m of ``phase`` (0-based)."""
        return self.replicas_per_phase[phase] if self.replicas_per_phase else self.num_replicas

    def replica_overrides(self, phase: int = 0) -> list[dict]:
        """The TrainingArguments each replica of ``phase`` changes: ``seed`` always, plus the lists that are set."""
        out = []
        for i in range(self.phase_replicas(phase)):
            h = {"seed": self.replica_seeds[i] if self.replica_seeds else self.seed + i}
            if self.replica_weight_decays:
                h["weight_decay"] = self.replica_weight_decays[i]
            if self.replica_learning_rates:  # the peak the retraining schedule restarts at
                h["learning_rate"] = h["pretrain_learning_rate"] = self.replica_learning_rates[i]
            if self.replica_epochs:
                h["num_train_epochs"] = self.replica_epochs[i]
            out.append(h)
        return out

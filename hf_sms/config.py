"""``SparseSoupConfig``: TrainingArguments plus what pruning, retraining and the soup need."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy

from .allocations import ALLOCATIONS, get_allocation, parse_n_of_m
from .baselines import BASELINES
from .merge import MERGE_METHODS
from .pruning import phase_sparsities
from .schedules import PRETRAIN_SHAPES, RETRAIN_SCHEDULES
from .seeding import derive_seed


@dataclass(kw_only=True, repr=False)  # keep TrainingArguments' repr, which masks tokens
class SparseSoupConfig(TrainingArguments):
    r"""Configuration of a Sparse Model Soups run; every TrainingArguments field applies to each replica.

    Parameters that control pruning:
        target_sparsity, n_phases, allocation.
    Parameters that control retraining (docs/method.md §3):
        retrain_schedule, pretrain_learning_rate, pretrain_min_learning_rate, pretrain_schedule,
        pretrain_epochs, retrain_warmup_fraction (``warmup_steps``, if set, takes precedence),
        decay_all_parameters. ``num_train_epochs`` / ``max_steps`` set the retraining length R per phase.
        ``lr_scheduler_type`` is used only with ``lr_schedule="original"`` (GMP, DPF, BIMP's pretraining).
    Parameters that control pruning during training (docs/method.md §7):
        pruning_method ("imp", "gmp", "dpf", "bimp"), pruning_steps, dpf_interval, bimp_pretrain_epochs,
        sms_start_epoch, lr_schedule. For gmp, dpf and bimp ``num_train_epochs`` is the whole budget.
    Parameters that control the soup:
        num_replicas, replicas_per_phase, replica_seeds, replica_weight_decays, replica_learning_rates, replica_epochs,
        merge_methods, greedy_keep_ties, recalibrate_bn, validation_fraction, baselines.

    Replica i of phase p (0-based) trains with seed ``derive_seed(seed, "sms", p, i)`` (or
    ``derive_seed(replica_seeds[i], "sms", p)``): independent streams for shuffling, augmentation and
    dropout, never ``seed + i`` (see :mod:`hf_sms.seeding`).

    Defaults changed from TrainingArguments, to the paper's settings: ``max_grad_norm=0`` (no gradient
    clipping), weight decay on every parameter (``decay_all_parameters``); and ``save_strategy="no"``
    (the SMS loop checkpoints finished replicas itself), ``logging_steps=50``.
    """

    # Pruning
    target_sparsity: float = field(default=0.9, metadata={"help": "Goal sparsity after the last phase, in [0, 1)."})
    n_phases: int = field(default=3, metadata={"help": "Number of prune-retrain(-merge) phases."})
    allocation: str = field(
        default="global",
        metadata={"help": f"How sparsity is spread over layers: one of {sorted(ALLOCATIONS)}, or 'n:m' (e.g. '2:4')."},
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
    retrain_warmup_fraction: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of each retraining phase warmed up (cosine from 0) for SLR, CLR, LLR, ALLR, as in the "
            "paper's code. A positive warmup_steps (steps, or a ratio < 1) overrides it."
        },
    )
    decay_all_parameters: bool = field(
        default=True,
        metadata={
            "help": "Weight decay on every parameter, biases and norms included, as torch.optim.SGD in the paper's "
            "code; False: transformers' default (no decay on biases and LayerNorm weights)."
        },
    )
    # Pruning during training (docs/method.md §7)
    pruning_method: str = field(
        default="imp",
        metadata={
            "help": "imp: prune a trained model, retrain, repeat (the SMS loop). gmp, dpf, bimp: prune during one "
            "training budget of num_train_epochs from the given model, +SMS per phase when num_replicas > 1."
        },
    )
    pruning_steps: int = field(default=9, metadata={"help": "GMP/DPF: pruning steps n, uniformly spaced (cubic)."})
    dpf_interval: int = field(default=16, metadata={"help": "DPF: iterations between mask recomputations."})
    bimp_pretrain_epochs: float | None = field(
        default=None, metadata={"help": "BIMP: dense epochs before its n_phases IMP cycles (within the budget)."}
    )
    sms_start_epoch: float | None = field(
        default=None,
        metadata={"help": "GMP/DPF/BIMP +SMS: phases starting at or after this epoch train m copies (default: all)."},
    )
    lr_schedule: str = field(
        default="retrain",
        metadata={
            "help": "retrain: the retraining schedule (retrain_schedule); original: lr_scheduler_type over the "
            "whole run (what GMP, DPF and BIMP's pretraining use; set by the loop for them)."
        },
    )
    # Soup
    num_replicas: int = field(default=3, metadata={"help": "Replicas m retrained per phase and merged."})
    replicas_per_phase: list[int] | None = field(
        default=None,
        metadata={"help": "m for each phase, each <= num_replicas (replica i uses the i-th entry of the lists)."},
    )
    replica_seeds: list[int] | None = field(
        default=None,
        metadata={"help": "Base seed of each replica; phase p uses derive_seed(replica_seeds[i], 'sms', p)."},
    )
    replica_weight_decays: list[float] | None = field(
        default=None, metadata={"help": "Weight decay of each replica (default: weight_decay for all)."}
    )
    replica_learning_rates: list[float] | None = field(
        default=None,
        metadata={
            "help": "Start LR of each replica; replicas then retrain with LLR from their own rate (the paper's code "
            "switches to LLR when the LR is what varies)."
        },
    )
    replica_epochs: list[float] | None = field(
        default=None, metadata={"help": "Retraining epochs of each replica (default: num_train_epochs)."}
    )
    merge_methods: list[str] = field(
        default_factory=lambda: ["uniform"],
        metadata={
            "help": "Soup methods, each its own SMS trajectory (phase p+1 starts from that method's soup); the first "
            "is the final soup. E.g. uniform greedy."
        },
    )
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
        default_factory=list, metadata={"help": f"Baselines run beside SMS: any of {sorted(BASELINES)}."}
    )
    measure_speedup: bool = field(
        default=True,
        metadata={
            "help": "Time the final soup dense vs the sparse runtime on one validation batch (main process) and "
            "report it beside the FLOP count in results.json, the table, sparsity.json and the model card."
        },
    )

    # Changed TrainingArguments defaults.
    max_grad_norm: float = field(default=0.0, metadata={"help": "Gradient clipping norm; 0: none (the paper's)."})
    save_strategy: SaveStrategy | str = field(
        default="no", metadata={"help": "Checkpoint strategy inside one replica's training."}
    )
    logging_steps: float = field(default=50, metadata={"help": "Log every X updates steps."})

    def __post_init__(self):
        super().__post_init__()
        phase_sparsities(self.target_sparsity, self.n_phases)  # raises ValueError on bad input
        choices = {
            "retrain_schedule": (self.retrain_schedule, RETRAIN_SCHEDULES),
            "pretrain_schedule": (self.pretrain_schedule, PRETRAIN_SHAPES),
        }
        if not self.merge_methods or len(set(self.merge_methods)) != len(self.merge_methods):
            raise ValueError(f"merge_methods={self.merge_methods} must name each soup method once, e.g. ['uniform']")
        unknown = sorted(set(self.merge_methods) - set(MERGE_METHODS))
        if unknown:
            raise ValueError(f"merge_methods {unknown} are unknown; choose from {sorted(MERGE_METHODS)}")
        nm = parse_n_of_m(self.allocation)
        get_allocation(self.allocation)  # raises, naming the choices, on an unknown one
        if nm is not None and abs(self.target_sparsity - (1 - nm[0] / nm[1])) > 1e-9:
            raise ValueError(
                f"allocation={self.allocation!r} prunes linear weights to exactly {1 - nm[0] / nm[1]:g}: set "
                f"target_sparsity={1 - nm[0] / nm[1]:g}"
            )
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is unknown; choose one of {sorted(allowed)}")
        unknown = sorted(set(self.baselines) - set(BASELINES))
        if unknown:
            raise ValueError(f"baselines {unknown} are unknown; choose from {sorted(BASELINES)}")
        if not isinstance(self.num_replicas, int) or isinstance(self.num_replicas, bool) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        if "imp_reprune" in self.baselines and self.num_replicas < 2:
            raise ValueError(
                "baselines=['imp_reprune'] averages num_replicas independent IMP runs, so it needs num_replicas >= 2"
            )
        if self.pretrain_epochs is not None and not self.pretrain_epochs > 0:
            raise ValueError(
                f"pretrain_epochs is the original training's length and must be > 0, got {self.pretrain_epochs}"
            )
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
        if self.replica_epochs is not None and self.max_steps > 0:
            raise ValueError(
                "replica_epochs varies the retraining length in epochs, but max_steps > 0 fixes it in steps; "
                "set max_steps=-1 (the default) or drop replica_epochs"
            )
        self._check_pruning_method()
        if not 0.0 <= self.retrain_warmup_fraction < 1.0:
            raise ValueError(f"retrain_warmup_fraction must be in [0, 1), got {self.retrain_warmup_fraction}")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        known_length = self.pretrain_epochs or (self.pruning_method == "bimp" and self.bimp_pretrain_epochs)
        if self.retrain_schedule in ("lrw", "slr", "allr") and not known_length:
            raise ValueError(
                f"retrain_schedule={self.retrain_schedule!r} needs the original training's length: set "
                "pretrain_epochs (e.g. --pretrain_epochs 90), or use retrain_schedule='llr'"
            )
        if self.retrain_schedule == "ft" and self.eta_min <= 0:
            raise ValueError("retrain_schedule='ft' trains at eta_min, which is 0 here: set pretrain_min_learning_rate")

    def _check_pruning_method(self) -> None:
        from .pruning_methods import PRUNING_METHODS  # the methods import the loop, which imports this module

        if self.pruning_method not in {"imp", *PRUNING_METHODS}:
            raise ValueError(
                f"pruning_method={self.pruning_method!r} is unknown; choose imp, {sorted(PRUNING_METHODS)}"
            )
        if self.lr_schedule not in ("retrain", "original"):
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is unknown; choose 'retrain' or 'original'")
        if self.pruning_method == "imp":
            return
        if self.baselines:
            raise ValueError(
                f"baselines compare against IMP; for pruning_method={self.pruning_method!r} run num_replicas=1 for "
                "the plain method beside the +SMS run instead"
            )
        if not isinstance(self.pruning_steps, int) or self.pruning_steps < 1:
            raise ValueError(f"pruning_steps must be an integer >= 1, got {self.pruning_steps!r}")
        if not isinstance(self.dpf_interval, int) or self.dpf_interval < 1:
            raise ValueError(f"dpf_interval must be an integer >= 1 (iterations), got {self.dpf_interval!r}")
        budget = self.num_train_epochs if self.max_steps <= 0 else None
        if self.sms_start_epoch is not None and (
            self.sms_start_epoch < 0 or (budget is not None and self.sms_start_epoch >= budget)
        ):
            raise ValueError(
                f"sms_start_epoch={self.sms_start_epoch} must lie in [0, num_train_epochs={self.num_train_epochs}); "
                "copies that start after the end never train"
            )
        if self.pruning_method == "bimp":
            if budget is None:
                raise ValueError("bimp splits a budget of num_train_epochs: set max_steps=-1")
            if self.bimp_pretrain_epochs is None or not 0 < self.bimp_pretrain_epochs < budget:
                raise ValueError(
                    f"bimp needs 0 < bimp_pretrain_epochs < num_train_epochs={budget} (the paper: 60 or 75 of 100), "
                    f"got {self.bimp_pretrain_epochs}"
                )

    # -- the Hub token never leaves the process ------------------------------------------------------------
    def __getstate__(self) -> dict:
        """Pickled without tokens: transformers saves the args as ``training_args.bin`` (a pickle) into every
        checkpoint, which ``push_to_hub`` would upload. Copies keep them (:meth:`__copy__`, :meth:`__deepcopy__`)."""
        return {k: None if k.endswith("_token") and isinstance(v, str) else v for k, v in self.__dict__.items()}

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

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
            key = (self.replica_seeds[i], "sms", phase) if self.replica_seeds else (self.seed, "sms", phase, i)
            h = {"seed": derive_seed(*key)}
            if self.replica_weight_decays:
                h["weight_decay"] = self.replica_weight_decays[i]
            if self.replica_learning_rates:  # LLR from lr_i: the replica starts at its own rate, not ALLR's clip
                h["learning_rate"] = h["pretrain_learning_rate"] = self.replica_learning_rates[i]
                h["retrain_schedule"] = "llr"
            if self.replica_epochs:
                h["num_train_epochs"] = self.replica_epochs[i]
            out.append(h)
        return out

    def phase_budget(self, phase: int) -> dict:
        """IMP_mx's retraining length in ``phase``: the sum of what the phase's m replicas train."""
        if self.max_steps > 0:
            return {"max_steps": self.max_steps * self.phase_replicas(phase)}
        epochs = [h.get("num_train_epochs", self.num_train_epochs) for h in self.replica_overrides(phase)]
        return {"num_train_epochs": float(sum(epochs)), "max_steps": -1}

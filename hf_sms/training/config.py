"""``SparseSoupConfig``: TrainingArguments plus what pruning, retraining and the soup need.

The hf-sms fields are one mixin, :class:`SparseSoupArguments`, composed with any Trainer's arguments class:
:class:`SparseSoupConfig` (TrainingArguments, the paper's defaults for an SMS run) here; Seq2Seq and any other
arguments class (trl's ``SFTConfig``) in :mod:`hf_sms.training.arguments`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy

from ..plan import PruningPlan, resolve_pruning
from ..pruning.masks import phase_sparsities
from ..registry import (
    ALLOCATIONS,
    BASELINES,
    PRETRAIN_SHAPES,
    PRUNING_METHODS,
    REPLICA_PARAMS,
    RETRAIN_SCHEDULES,
    SOUPS,
)
from ..seeding import derive_seed
from ..soup.options import resolve_soup_options
from .config_checks import check_lengths_and_ranges


@dataclass(kw_only=True, repr=False)  # keep TrainingArguments' repr, which masks tokens
class SparseSoupArguments:
    r"""What pruning, retraining and the soup need, mixed into a Trainer's arguments class (see
    :class:`SparseSoupConfig`, :func:`sparse_config`); every field of that class applies to each replica.

    Parameters that control pruning:
        target_sparsity, n_phases, allocation, structure, criterion, unit_multiple, fit_config, prune_modules,
        skip_modules (see :func:`hf_sms.compute_masks`); resolved once into ``plan`` (:class:`hf_sms.plan.PruningPlan`).
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
        merge_methods, soup_options, greedy_keep_ties, pairwise_soups, recalibrate_bn, validation_fraction,
        baselines.

    Replica i of phase p (0-based) trains with seed ``derive_seed(seed, "sms", p, i)`` (or
    ``derive_seed(replica_seeds[i], "sms", p)``): independent streams for shuffling, augmentation and
    dropout, never ``seed + i`` (see :mod:`hf_sms.seeding`).

    Mixed into another arguments class, every default of that class stays as it is (``decay_all_parameters`` is
    False there: the Trainer's own weight decay); :class:`SparseSoupConfig` sets the paper's.
    """

    # Pruning
    target_sparsity: float = field(default=0.9, metadata={"help": "Goal sparsity after the last phase, in [0, 1)."})
    n_phases: int = field(default=3, metadata={"help": "Number of prune-retrain(-merge) phases."})
    allocation: str | None = field(
        default=None,
        metadata={
            "help": "How sparsity is spread over layers: a name in hf_sms.registry.ALLOCATIONS (default: 'global' "
            "for unstructured pruning, 'uniform' for units); the older 'filter_l2', 'filter_l1' and 'n:m' still work."
        },
    )
    structure: str | None = field(
        default=None,
        metadata={
            "help": "Which weights fall together: 'unstructured' (default), 'filters', 'neurons', 'heads', 'n:m' "
            "(2:4), or units joined by '+' ('neurons+heads'). For units target_sparsity is the fraction of units "
            "removed per layer, and the final soup is saved as a plain smaller model (hf_sms.shrink)."
        },
    )
    criterion: str | None = field(
        default=None,
        metadata={
            "help": "What a weight is worth: a name in hf_sms.registry.CRITERIA (magnitude (default for weights), "
            "l1, l2 (default for units: Li et al.'s L2 norm), random, wanda)."
        },
    )
    unit_multiple: int = field(
        default=1,
        metadata={
            "help": "Units: every layer keeps a multiple of this many units (the next best stay), widths "
            "tensor-core kernels run at full rate (8 for bf16 GEMMs); 1: exactly the target's count."
        },
    )
    fit_config: bool = field(
        default=True,
        metadata={
            "help": "Units: prune only units the model family's own config can state, so the final soup is a "
            "smaller model transformers/timm/smp load without hf-sms; False: every unit the model's graph has "
            "(smaller still, loaded with hf_sms.load_sparse)."
        },
    )
    prune_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules to prune, as peft's target_modules (names or their last parts; in Python also one "
            "regular expression as a string). Default: every prunable weight; a causal LM's decoder linear layers "
            "(embeddings and lm_head stay dense, as Wanda and SparseGPT leave them)."
        },
    )
    skip_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules left dense, of those prune_modules (or its default) selects."}
    )
    # Retraining
    retrain_schedule: str = field(
        default="llr", metadata={"help": "Retraining LR schedule: ft, lrw, slr, clr, llr or allr."}
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
        default="linear",
        metadata={"help": "Shape of the original LR schedule: a name in hf_sms.registry.PRETRAIN_SHAPES."},
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
        default=False,
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
            "whole run (what GMP, DPF and BIMP's pretraining use; set by the loop for them); pretrain: dense "
            "training along pretrain_schedule from learning_rate (the recipes' pretraining)."
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
    soup_options: dict | str | None = field(
        default=None, metadata={"help": 'Soup methods\' options, e.g. \'{"ties": {"density": 0.2}}\' (JSON).'}
    )
    greedy_keep_ties: bool = field(
        default=False, metadata={"help": "Greedy soup keeps a candidate that ties the metric (the SMS code's >=)."}
    )
    pairwise_soups: bool = field(
        default=False,
        metadata={
            "help": "Also score the uniform soup of every pair of a phase's replicas (recalibrated; validation and "
            "test): results.json's sms[p].pair_soups and the scatter in results.png, as the paper's appendix."
        },
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
        default_factory=list,
        metadata={
            "help": "Baselines run beside SMS: any of imp, imp_mx, imp_phases, imp_swa, swamp, imp_reprune, "
            "imp_reprune_cia, imp_reprune_caa."
        },
    )
    replica_params: str = field(
        default="all",
        metadata={
            "help": "What a replica trains: all, bias_norm, mask_lora, scale_lora, mask_lora_norms / "
            "scale_lora_norms (the adapters and the norm weights), or mask_lora_bias_norm / scale_lora_bias_norm "
            "(the adapters, biases and norms: PERP's default; docs/replicas.md)."
        },
    )
    lora_rank: int = field(default=16, metadata={"help": "Rank of mask_lora / scale_lora adapters."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha: the update is scaled by alpha / rank."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapters' input."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names the adapters wrap (default: every prunable nn.Linear)."}
    )
    replica_sharding: str = field(
        default="none",
        metadata={
            "help": "none, or fsdp: on N = k * num_replicas processes (k >= 2), each replica trains sharded over its "
            "group of k with FSDP2 (weights, gradients and optimizer state split k ways: a replica larger than one "
            "device), instead of data-parallel; full replicas only (docs/parallel.md)."
        },
    )
    share_idle_groups: bool = field(
        default=False,
        metadata={
            "help": "On several process groups: where a phase's last job would leave groups idle, train it "
            "data-parallel over every group free at that moment (same global batch). Faster; its BatchNorm statistics "
            "and dropout masks then differ from a one-process run's (docs/parallel.md)."
        },
    )
    resume: str = field(
        default="auto",
        metadata={
            "help": "auto: resume a run in output_dir only if config, model and data match; force: also when the "
            "training data is a stream hf-sms cannot identify (you vouch it is the same)."
        },
    )
    measure_speedup: bool = field(
        default=True,
        metadata={
            "help": "Time each phase's soup dense vs the sparse runtime on one validation batch (main process) and "
            "report it beside the FLOP count: its row in results.json and the table; the final soup's also in "
            "sparsity.json and the model card."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        phase_sparsities(self.target_sparsity, self.n_phases)  # raises ValueError on bad input
        if not self.merge_methods or len(set(self.merge_methods)) != len(self.merge_methods):
            raise ValueError(f"merge_methods={self.merge_methods} must name each soup method once, e.g. ['uniform']")
        if not isinstance(self.num_replicas, int) or isinstance(self.num_replicas, bool) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas!r}")
        given = {"allocation": self.allocation, "structure": self.structure, "criterion": self.criterion}
        try:
            self.plan: PruningPlan = resolve_pruning(
                **given,
                seed=derive_seed(self.seed, "pruning"),
                unit_multiple=self.unit_multiple,
                fit_config=self.fit_config,
                prune_modules=self.prune_modules,
                skip_modules=self.skip_modules,
            )
            self.plan.validate(self.target_sparsity)
        except ValueError as e:
            raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in given.items() if v is not None)}: {e}") from None
        if self.allocation is None:  # recorded as what it means, so a run folder says it
            self.allocation = self.plan.allocation
        # Every named piece must exist, and passes its own check of this config (the registries own the rules).
        named = [
            ("allocation", ALLOCATIONS, [self.allocation]),
            ("retrain_schedule", RETRAIN_SCHEDULES, [self.retrain_schedule]),
            ("pretrain_schedule", PRETRAIN_SHAPES, [self.pretrain_schedule]),
            ("merge_methods", SOUPS, self.merge_methods),
            ("baselines", BASELINES, self.baselines),
            ("replica_params", REPLICA_PARAMS, [self.replica_params]),
            ("pruning_method", PRUNING_METHODS, [] if self.pruning_method == "imp" else [self.pruning_method]),
        ]
        for field_name, registry, values in named:
            for value in values:
                try:
                    registry.check(value, self)
                except ValueError as e:
                    raise ValueError(f"{field_name}={value!r}: {e}") from None
        self.soup_options = resolve_soup_options(self)
        check_lengths_and_ranges(self)

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


@dataclass(kw_only=True, repr=False)
class SparseSoupConfig(SparseSoupArguments, TrainingArguments):
    r"""Configuration of a Sparse Model Soups run: TrainingArguments plus :class:`SparseSoupArguments`.

    Defaults changed from TrainingArguments, to the paper's settings: ``max_grad_norm=0`` (no gradient
    clipping), weight decay on every parameter (``decay_all_parameters``); and ``save_strategy="no"``
    (the SMS loop checkpoints finished replicas itself), ``logging_steps=50``.
    """

    decay_all_parameters: bool = field(
        default=True, metadata={"help": "Weight decay on every parameter (the paper's); False: transformers' default."}
    )
    max_grad_norm: float = field(default=0.0, metadata={"help": "Gradient clipping norm; 0: none (the paper's)."})
    save_strategy: SaveStrategy | str = field(
        default="no", metadata={"help": "Checkpoint strategy inside one replica's training."}
    )
    logging_steps: float = field(default=50, metadata={"help": "Log every X updates steps."})

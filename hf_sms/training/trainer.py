"""``SparseSoupTrainer``: transformers' Trainer with masks kept exact and retraining LR schedules.

The hooks are one mixin, :class:`SparseSoupMixin`, for any Trainer subclass: ``SparseSoupTrainer`` (Trainer) and
``SparseSoupSeq2SeqTrainer`` (Seq2SeqTrainer, ``predict_with_generate``) ship ready-made;
``class MyTrainer(SparseSoupMixin, SFTTrainer)`` composes with trl's and any other (docs/trainer.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint, has_length

from ..adapters.folders import ADAPTER_FOLDER, MERGED_NOTE, save_adapter
from ..adapters.merge import check_mergeable
from ..adapters.replica import adapted, adapter_masks, kind_of, make_replica, merged_copy
from ..batchnorm import recalibrate_batchnorm
from ..checkpoint import save_sparse
from ..checkpoint.constants import MASKS_NAME
from ..checkpoint.trainer_card import merge_trainer_card, read_card
from ..checkpoint.trainer_masks import load_pruning_step, save_masks
from ..families import family_of
from ..master_weights import MasterWeightsCallback
from ..pruning.enforcement import ExactMasking, MaskEnforcer, MaskingPolicy, unwrap_optimizer
from ..pruning.masks import PruningStep, apply_masks, is_sharded
from ..pruning.prunable import Masks
from ..seeding import EpochShuffleSampler
from .arguments import as_sparse_arguments, sparse_config
from .config_checks import LR_SCHEDULES
from .schedules import PRETRAIN_SHAPES, ScheduleContext, allr_start_lr, make_lr_scheduler, steps_per_epoch
from .sharding import full_model

logger = logging.getLogger("hf_sms")


def cross_entropy_loss(outputs, labels, num_items_in_batch=None):
    """Default loss for models that return logits (timm, smp, plain modules); -100 labels are ignored."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


class _MaskCallback(TrainerCallback):
    """Hands the Trainer's events to the masking policy."""

    def __init__(self, trainer: SparseSoupTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        trainer = self.trainer
        if trainer.enforcer.replaced(trainer.model):  # FSDP2 sharded the model as training began: new parameters
            trainer._bind(trainer.masks)
        trainer.masking.start(optimizer)  # also cleans optimizer state restored on resume
        if optimizer is not None:  # masks kept even where a subclass's training_step skips the mixin's
            self.hook = unwrap_optimizer(optimizer).register_step_pre_hook(self.trainer._before_optimizer_step)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.trainer.masking.after_step(optimizer)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        self.trainer.masking.end(optimizer)
        if getattr(self, "hook", None) is not None:
            self.hook.remove()
            self.hook = None


def _shifted(lr_lambda, offset: int, step: int) -> float:
    return lr_lambda(step + offset)


class SparseSoupMixin:
    """Retrains a pruned model: pruned weights stay exactly zero, the LR follows a retraining schedule. Mixed into a
    Trainer subclass (``class MyTrainer(SparseSoupMixin, Seq2SeqTrainer)``), it overrides a few of its methods and
    calls the class's own for the rest.

    Args:
        model: a transformers, timm, smp or plain torch model. Plain models get a cross-entropy loss on
            ``labels`` unless ``compute_loss_func`` is given.
        args: arguments with the hf-sms fields (:class:`~hf_sms.SparseSoupConfig`,
            :class:`~hf_sms.SparseSoupSeq2SeqConfig`, :func:`~hf_sms.sparse_config` of any arguments class); plain
            ``TrainingArguments`` (or a subclass) are converted with every value kept.
        masks: the masks to train under, as a ``{name: bool tensor}`` dict or a :class:`PruningStep`
            (which also carries ALLR's norm drop). If ``None``, the model is magnitude-pruned to
            ``args.target_sparsity`` with ``args.allocation`` in one shot.
        process_group: train data-parallel over this ``torch.distributed`` group only (one replica's group
            of processes in a replica-parallel SMS run; see :mod:`hf_sms.loop.distributed`). ``None``: the
            usual accelerate behaviour.
        lr_schedule: ``"retrain"``: the retraining schedule ``args.retrain_schedule`` (docs/method.md §3);
            ``"original"``: transformers' own ``args.lr_scheduler_type`` schedule, for pruning during
            training (GMP, DPF; docs/method.md §7); ``"pretrain"``: dense training along
            ``PRETRAIN_SHAPES[args.pretrain_schedule]`` from ``args.learning_rate`` (the shape LRW, SLR and ALLR
            then assume; pass ``masks={}``). ``None``: ``args.lr_schedule`` if set, else ``"retrain"``.
        masking: the :class:`~hf_sms.pruning.enforcement.MaskingPolicy` that keeps the masks (default
            :class:`~hf_sms.pruning.enforcement.ExactMasking`; DPF hands its
            :class:`~hf_sms.methods.dpf.FeedbackMasking`).
        step_offset, total_steps: this trainer runs global iterations ``step_offset + 1`` to
            ``step_offset + max_steps`` of a run of ``total_steps`` (default ``step_offset + max_steps``),
            e.g. one phase of GMP+SMS. The ``"original"`` schedule and the callbacks of
            :mod:`hf_sms.methods.gmp` use these global iteration numbers.
        **kwargs: passed to ``Trainer``.

    ``masks={}`` starts dense (nothing is masked until a callback calls :meth:`set_masks`).
    """

    arguments_class = TrainingArguments  # what args=None builds (with the hf-sms fields)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer in mro and mro.index(Trainer) < mro.index(SparseSoupMixin):
            base = next(b for b in cls.__bases__ if issubclass(b, Trainer))
            raise TypeError(
                f"class {cls.__name__}: SparseSoupMixin must come before {base.__name__} in the bases, else "
                f"{base.__name__}'s methods run instead of the mixin's and the model trains dense; write "
                f"class {cls.__name__}(SparseSoupMixin, {base.__name__})"
            )

    def __init__(
        self,
        model=None,
        args: TrainingArguments | None = None,
        masks: Masks | PruningStep | None = None,
        process_group=None,
        lr_schedule: str | None = None,
        masking: MaskingPolicy | None = None,
        step_offset: int = 0,
        total_steps: int | None = None,
        **kwargs,
    ):
        if args is None:
            args = sparse_config(self.arguments_class)(output_dir="tmp_trainer")
        args = as_sparse_arguments(args, self.arguments_class)
        own = isinstance(model, nn.Module) and (adapted(model) or getattr(model, "hf_sms_replica", False))
        if isinstance(model, nn.Module) and not kind_of(args).full and not own:
            model = make_replica(model, args)  # trains args.replica_params; the rest shared with the model, frozen
        if isinstance(model, nn.Module):  # what the model's library needs (smp's config, a loss for logits-only models)
            family = family_of(model.get_base_model() if hasattr(model, "get_base_model") else model)
            family.prepare_training(model)
            if not family.computes_loss:
                kwargs.setdefault("compute_loss_func", cross_entropy_loss)
                if args.label_names is None:
                    args.label_names = ["labels"]
        super().__init__(model=model, args=args, **kwargs)
        self.adapted = isinstance(self.model, nn.Module) and adapted(self.model)
        if isinstance(self.model, nn.Module) and hasattr(self.model, "peft_config"):
            check_mergeable(self.model)  # the final save merges under the mask: what it cannot merge, refused now
        if masks is None:  # a model that arrives with zeros keeps them (PruningPlan.arriving)
            step = args.plan.arriving(self.model, args.target_sparsity, self.adapted, self._example_batch)
        elif isinstance(masks, PruningStep):
            step = dataclasses.replace(masks, masks=adapter_masks(self.model, masks.masks)) if self.adapted else masks
        else:
            step = PruningStep.measure(self.model, adapter_masks(self.model, masks) if self.adapted else masks)
        if step.masks and not any(bool(m.any()) for m in step.masks.values()):
            raise ValueError("the masks prune every weight (all False): nothing would train; True marks a kept weight")
        self.lr_schedule = lr_schedule or getattr(args, "lr_schedule", "retrain")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is unknown; choose one of {LR_SCHEDULES}")
        if step_offset < 0 or (total_steps is not None and total_steps <= step_offset):
            raise ValueError(f"need 0 <= step_offset < total_steps, got {step_offset} and {total_steps}")
        self.step_offset, self.total_steps = step_offset, total_steps
        self.pruning_step = step
        self.process_group = process_group
        self.masking = masking if masking is not None else ExactMasking()
        if self.masking.zeroes_at_start:  # DPF keeps the dense values it was handed
            apply_masks(self.model, step.masks)
        self._bind(step.masks)
        for callback in (_MaskCallback(self), MasterWeightsCallback(self)):  # masks; bf16 norms in float32
            self.add_callback(callback)

    def _example_batch(self):
        """Two training items through the collator (units are found by tracing a batch), or None."""
        data = self.train_dataset
        if data is None or not has_length(data) or len(data) == 0:
            return None
        return self.data_collator([data[i] for i in range(min(2, len(data)))])

    @property
    def masks(self) -> Masks:
        return self.enforcer.masks

    def set_masks(self, masks: Masks, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Train under ``masks`` from now on (pruning during training, :mod:`hf_sms.methods`); the masking policy
        decides what that does to the weights and optimizer state now (``new_masks``)."""
        self.pruning_step = PruningStep.measure(self.model, masks)
        self._bind(masks)
        self.masking.new_masks(optimizer)

    def _bind(self, masks: Masks) -> None:
        self._fsdp = isinstance(self.model, nn.Module) and any(is_sharded(p) for p in self.model.parameters())
        self.enforcer = MaskEnforcer(self.model, masks)
        self.masking.bind(self.enforcer)

    def set_masking(self, masking: MaskingPolicy) -> None:
        """Use another masking policy from now on (e.g. DPF's, installed by its callback)."""
        self.masking = masking
        masking.bind(self.enforcer)

    # -- the hooks that keep masks exact --------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.masking.forward_context():
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # last micro-batch: mask before clipping and the step
            if self.process_group is not None and not self._fsdp:  # FSDP2 averaged them in its reduce-scatter
                self._average_gradients_in_group()
            self.masking.before_step()
            self._masked_step = True
        return loss

    _masked_step = False

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's pre-step hook: mask the gradients if this step's ``training_step`` did not (a subclass
        that overrides it without ``super()``); free where it did."""
        if not self._masked_step:
            self.masking.before_step()
        self._masked_step = False

    def evaluate(self, *args, **kwargs):
        with self.masking.forward_context():  # DPF is judged by the sparse model it returns
            return super().evaluate(*args, **kwargs)

    @torch.no_grad()
    def _average_gradients_in_group(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=self.process_group)
        flat /= torch.distributed.get_world_size(self.process_group)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def _get_train_sampler(self, train_dataset=None):
        # Transformers' RandomSampler becomes accelerate's SeedableRandomSampler, which seeds epoch e with
        # seed + e: replicas seeded s and s + 1 would replay each other's orders one epoch apart.
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy != "random" or dataset is None or not has_length(dataset):
            return super()._get_train_sampler(train_dataset)
        group = self.process_group
        shards = {"num_shards": dist.get_world_size(group), "shard": dist.get_rank(group)} if group else {}
        return EpochShuffleSampler(len(dataset), self.args.seed, **shards)

    def get_decay_parameter_names(self, model) -> list[str]:
        if self.args.decay_all_parameters:  # torch.optim.SGD(model.parameters(), weight_decay=...) as in the paper
            return [name for name, _ in model.named_parameters()]
        return super().get_decay_parameter_names(model)

    def _retrain_epochs(self, num_training_steps: int) -> float:
        args = self.args
        try:
            world = torch.distributed.get_world_size(self.process_group) if self.process_group else args.world_size
            examples = len(self.train_dataset)
        except TypeError:  # iterable dataset
            return float(args.num_train_epochs)
        accumulation = args.gradient_accumulation_steps
        return num_training_steps / steps_per_epoch(examples, args.train_batch_size, world, accumulation)

    def _original_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None):
        total = self.total_steps or self.step_offset + num_training_steps
        scheduler = super().create_scheduler(total, optimizer)
        if self.step_offset:  # a phase of a longer run: the rates of its global iterations
            if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                raise ValueError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} cannot start at a step_offset")
            shifted = [functools.partial(_shifted, f, self.step_offset) for f in scheduler.lr_lambdas]
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(scheduler.optimizer, shifted)
        return self.lr_scheduler

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None and self.lr_schedule == "original":
            return self._original_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None and self.lr_schedule == "pretrain":
            shape, lo = PRETRAIN_SHAPES[self.args.pretrain_schedule], self.args.eta_min / self.args.eta_max
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, lambda step: shape(step / num_training_steps, 1.0, lo)
            )
            self._created_lr_scheduler = True
            return self.lr_scheduler
        if self.lr_scheduler is None:
            args = self.args
            ratio = self._retrain_epochs(num_training_steps) / args.pretrain_epochs if args.pretrain_epochs else 1.0
            start = allr_start_lr(
                self.pruning_step.norm_fraction, self.pruning_step.phase_fraction, args.eta_max, ratio
            )
            warmup = (
                args.get_warmup_steps(num_training_steps)
                if args.warmup_steps > 0
                else math.ceil(args.retrain_warmup_fraction * num_training_steps)
            )
            ctx = ScheduleContext(
                num_training_steps, args.eta_max, args.eta_min, args.pretrain_schedule, ratio, start, warmup
            )
            self.lr_scheduler = make_lr_scheduler(optimizer or self.optimizer, args.retrain_schedule, ctx)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs["weight_sparsity"] = round(self.masking.sparsity(), 6)  # achieved: pruned weights / maskable
        super().log(logs, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        push, self.args.push_to_hub = self.args.push_to_hub, False  # Trainer would push before the sparse save
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.args.push_to_hub = push
        final = not _internal_call or self._pushing  # the final save: from_pretrained loads it after import hf_sms
        model = full_model(self.model) if final else None  # sharded by FSDP2: gathered, every process takes part
        if self.args.should_save:
            folder = output_dir or self.args.output_dir
            save_masks(self.masks, folder, self.pruning_step)
            if final:
                card = read_card(folder)  # one create_model_card wrote before, if any
                if self.adapted:  # the merged sparse model, and the adapter in peft's format beside it
                    for name in ("adapter_config.json", "adapter_model.safetensors"):  # the Trainer's PeftModel save
                        if os.path.isfile(os.path.join(folder, name)):
                            os.remove(os.path.join(folder, name))
                    save_adapter(self.model, os.path.join(folder, ADAPTER_FOLDER))
                model = merged_copy(model) if self.adapted else model
                recipe = {"notes": [MERGED_NOTE]} if self.adapted else None
                save_sparse(model, folder, recipe=recipe, processing_class=self.processing_class)
                merge_trainer_card(folder, card)
                if self.args.plan.cuts_units:  # the run loop saves the smaller model; here it is one call away
                    structure = self.args.plan.describe().get("structure")
                    logger.warning(
                        "[hf-sms] structure=%r: %s holds the pruned model with its removed units as zeros, not the "
                        "smaller model; hf_sms.shrink(trainer.model, batch) cuts it, then hf_sms.save_sparse saves "
                        "that (docs/trainer.md)",
                        structure,
                        folder,
                    )
        if push and not _internal_call:  # what Trainer.save_model does, once the folder is the soup's
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    _pushing = False

    def push_to_hub(self, *args, **kwargs):
        """transformers' push, of the folder with the soup saved as hf-sms saves it (its save before the upload is
        a final one: a checkpoint's dense weights would overwrite the sparse ones)."""
        self._pushing = True
        try:
            return super().push_to_hub(*args, **kwargs)
        finally:
            self._pushing = False

    def create_model_card(self, *args, **kwargs) -> None:
        """transformers' card of the run, under hf-sms's card (which says first whether loading needs hf-sms)
        where the output folder holds a saved soup; ``push_to_hub`` uploads that."""
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            merge_trainer_card(self.args.output_dir, read_card(self.args.output_dir))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:  # as Trainer says it: never a silent fresh start
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if isinstance(resume_from_checkpoint, str):
            saved = load_pruning_step(resume_from_checkpoint, fallback=self.pruning_step)
            if saved is None:
                raise ValueError(
                    f"{resume_from_checkpoint} holds no {MASKS_NAME}: it was not saved by SparseSoupTrainer"
                )
            self.pruning_step = saved
            self._bind(saved.masks)
        for callback in self.callback_handler.callbacks:  # e.g. GradualPruning: it prunes through this trainer
            if hasattr(callback, "bind_trainer"):
                callback.bind_trainer(self)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def recalibrate_batchnorm(self, dataset=None, max_batches: int | None = None):
        """Exact BatchNorm statistics over the training data in a fixed order (docs/method.md §5)."""
        dataset = dataset if dataset is not None else self.train_dataset
        loader = torch.utils.data.DataLoader(
            self._remove_unused_columns(dataset, "training") if hasattr(dataset, "column_names") else dataset,
            batch_size=self.args.per_device_train_batch_size,
            shuffle=False,
            collate_fn=self.data_collator,
        )
        limit = max_batches if max_batches is not None else self.args.bn_recalibration_batches
        return recalibrate_batchnorm(self.model, loader, limit)


class SparseSoupTrainer(SparseSoupMixin, Trainer):
    """transformers' ``Trainer`` with :class:`SparseSoupMixin`: pruned weights stay exactly zero, the LR follows a
    retraining schedule (the arguments are documented there)."""


class SparseSoupSeq2SeqTrainer(SparseSoupMixin, Seq2SeqTrainer):
    """transformers' ``Seq2SeqTrainer`` with :class:`SparseSoupMixin`: ``predict_with_generate`` and the generation
    arguments work as in ``Seq2SeqTrainer``; use :class:`~hf_sms.SparseSoupSeq2SeqConfig` (or plain
    ``Seq2SeqTrainingArguments``, converted with every value kept)."""

    arguments_class = Seq2SeqTrainingArguments

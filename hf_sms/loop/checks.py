"""Checks of a run's inputs, made before any training so that a mistake costs seconds, not a run."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping

import torch
from transformers.trainer_utils import has_length

from ..batchnorm import forward_batch
from ..data import peek
from ..pruning.prunable import (
    accepts_labels,
    check_weights_loaded,
    parameter_count,
    prunable_tensors,
    unfused_attention,
)
from ..training.trainer import SparseSoupMixin

logger = logging.getLogger(__name__)


def check_inputs(args, train_dataset, eval_dataset, metric_fn) -> None:
    """Raise ``ValueError`` saying how to fix whatever would make the SMS loop fail after training began."""
    if not callable(metric_fn):
        raise ValueError(
            f"metric_fn must be a callable metric_fn(model, dataset) -> float (higher is better), got {metric_fn!r}; "
            "e.g. hf_sms.evaluation.metrics.ClassificationAccuracy()"
        )
    for name, data in (("training", train_dataset), ("validation", eval_dataset)):
        if data is None or (has_length(data) and len(data) == 0):
            raise ValueError(
                f"the {name} set is empty; pass more data, or lower validation_fraction "
                f"(now {args.validation_fraction}) if the validation split took everything"
            )
    item = peek(train_dataset, 0) if has_length(train_dataset) else None
    labels = args.label_names or ["labels"]
    if isinstance(item, Mapping) and not all(name in item for name in labels):
        raise ValueError(
            f"training items have keys {sorted(item)} but no {labels}: the loss needs labels. Name the label "
            "column 'labels' (dataset.rename_column('label', 'labels')) or set label_names"
        )
    if args.push_to_hub:
        check_hub_access(args.hub_token)


def check_trainer_class(trainer_class):
    """``trainer_class`` itself, if it is a :class:`~hf_sms.SparseSoupMixin` class (the mixin keeps the masks)."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, SparseSoupMixin)):
        raise TypeError(f"trainer_class must be a SparseSoupMixin subclass (it keeps the masks), got {trainer_class}")
    return trainer_class


def check_hub_access(token: str | None) -> None:
    """Fail now, not after the run, when the final soup could not be pushed (offline, or no credentials)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ValueError("push_to_hub=True but HF_HUB_OFFLINE is set; unset it, or drop --push_to_hub")
    from huggingface_hub import HfApi

    try:
        HfApi(token=token).whoami()
    except Exception as e:  # offline, bad token, not logged in: all end the same way after hours of training
        raise ValueError(
            f"push_to_hub=True but the Hub does not accept these credentials ({type(e).__name__}); log in with "
            "`hf auth login` or pass --hub_token, or drop --push_to_hub (checked before training)"
        ) from None


def check_model(args, model, example: Callable[[], object] | None = None, warn: bool = True) -> None:
    """Raise before any work where ``model`` has no weights yet (the meta device) or the run's plan cannot prune it
    (:meth:`hf_sms.plan.PruningPlan.check`: no unit of its structure, a layer emptied at the target, an n:m pattern
    that fits no layer); with ``warn`` (the main process), warn about weights no forward uses
    (:func:`warn_unused_weights`) and say how much smaller a unit run's final soup will be (:func:`preview_shrink`).
    Both skip models above 1B parameters: a backward or a copy costs more than a log line is worth there."""
    check_weights_loaded(model)
    batch = example() if example is not None else None
    args.plan.check(model, args.target_sparsity, batch)
    if warn and batch is not None and parameter_count(model) <= 1e9:
        warn_unused_weights(model, batch)
        preview_shrink(args, model, batch)


def _outputs(out) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, a tuple, a dict or a ``ModelOutput``) that carry gradients."""
    if torch.is_tensor(out):
        return [out] if out.requires_grad else []
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return [t for item in items for t in _outputs(item)]


def _first_example(batch):
    """``batch`` cut to its first example (still a batch): which weights a forward uses does not depend on how many
    examples it sees, and the graph of one example holds 1 / B of the activations (batch 8 x 256 tokens: 2.5x a
    110M LLaMA's bytes, more than a subset replica's whole phase; benchmarks/replica_memory.py)."""
    if torch.is_tensor(batch):
        return batch[:1] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return {k: _first_example(v) for k, v in batch.items()}
    if type(batch) in (tuple, list):
        return type(batch)(_first_example(v) for v in batch)
    return batch


def warn_unused_weights(model, batch) -> list[str]:
    """Warn where prunable weights get no gradient from a forward on ``batch`` (in eval mode): they are pruned and
    counted in the sparsity like the others, which skews a global allocation and every reported sparsity. smp's
    own encoders at ``encoder_depth < 5`` keep the stages they do not use, for one. Returns their names."""
    tensors = [t for t in prunable_tensors(model) if t.param.requires_grad]
    if not tensors:
        return []
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), unfused_attention():
            device = next(model.parameters()).device
            out = forward_batch(model, _first_example(batch), device, keep_labels=accepts_labels(model))
            loss = getattr(out, "loss", None)
            outputs = [loss] if torch.is_tensor(loss) and loss.requires_grad else _outputs(out)
            if not outputs:
                return []
            total = sum(o.float().sum() for o in outputs)
            reached = _leaves(total)  # the graph's leaves: no backward, no gradient memory (a model's worth)
            grads = [True if id(t.param) in reached else None for t in tensors]
    except (RuntimeError, TypeError, ValueError) as e:  # a batch this check cannot feed: the run finds out itself
        logger.debug("[hf-sms] unused-weight check skipped: %r", e)
        return []
    finally:
        model.train(was_training)
    unused = [t for t, g in zip(tensors, grads) if g is None]
    if unused:
        count = sum(t.param.numel() for t in unused)
        names = ", ".join(t.name for t in unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        logger.warning(
            "[hf-sms] %s prunable weights (%.1f%% of them) get no gradient on a training batch: %s. They are pruned "
            "and counted in the sparsity like the rest, which skews a global allocation and the reported sparsity. "
            "Remove those layers from the model (smp: a `tu-` encoder builds only the stages it uses), or ignore "
            "this if they serve other inputs (experts, training-only heads)",
            f"{count:,}",
            100 * count / sum(t.param.numel() for t in tensors),
            names,
        )
    return [t.name for t in unused]


def _leaves(output: torch.Tensor) -> set[int]:
    """``id`` of every tensor ``output``'s autograd graph accumulates a gradient into: the weights a backward
    would reach (what ``torch.autograd.grad(..., allow_unused=True)`` returns no ``None`` for)."""
    seen, stack, leaves = set(), [output.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf tensor
            leaves.add(id(fn.variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves


def preview_shrink(args, model, batch) -> float | None:
    """Log, before training, the parameters of the final soup of ``model`` pruned once to the target, against the
    dense ones: about what the run's final soup will have (its units are chosen by training, their numbers are
    not). Warn where it would hardly be smaller. ``None`` where the final soup keeps the model's shapes."""
    try:
        with warnings.catch_warnings():  # shrink's note on the zeros it keeps: the line below says it
            warnings.simplefilter("ignore", UserWarning)
            final = args.plan.preview(model, args.target_sparsity, batch)
        if final is None:
            return None
        ratio = parameter_count(final.model) / parameter_count(model)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        logger.warning("[hf-sms] could not preview the smaller model (%s); training goes on", str(e)[:200])
        return None
    structure, target = args.plan.describe()["structure"], args.target_sparsity
    if ratio > 0.95:
        why = (final.shrunk.why if final.shrunk else None) or (
            "its removed units stay as zeros where its family's config cannot state the widths; fit_config=False "
            "prunes and cuts more"
        )
        logger.warning(
            "[hf-sms] structure=%r at %g: the final soup will be pruned but hardly smaller (about %.3fx the dense "
            "parameters): %s",
            structure,
            target,
            ratio,
            why,
        )
    else:
        logger.info(
            "[hf-sms] structure=%r at %g: the final soup will have about %.3fx the dense parameters",
            structure,
            target,
            ratio,
        )
    return ratio


def check_world(args, world) -> None:
    """A replica data-parallel over a group of k processes keeps the run's batch, ``per_device_train_batch_size``
    (the paper's: replicas retrain at the pretraining batch), split k ways: it must divide."""
    k = world.group_size
    if getattr(args, "replica_sharding", "none") == "fsdp" and k < 2:
        raise ValueError(
            f"replica_sharding='fsdp' shards each replica over its group of processes, but {world.size} process(es) "
            f"for num_replicas={args.num_replicas} give groups of one: launch k * num_replicas processes with k >= 2 "
            "(e.g. torchrun --nproc_per_node 2 with num_replicas=1), or set replica_sharding='none'"
        )
    if k > 1 and args.per_device_train_batch_size % k:
        raise ValueError(
            f"each replica trains data-parallel over {k} processes at the run's batch per_device_train_batch_size="
            f"{args.per_device_train_batch_size}, split {k} ways: give a batch size divisible by {k}, or launch "
            "at most num_replicas processes"
        )

"""Checks of a run's inputs, made before any training so that a mistake costs seconds, not a run."""

from __future__ import annotations

import os
from collections.abc import Mapping

from transformers.trainer_utils import has_length

from ..data import peek
from ..pruning.prunable import prunable_tensors
from ..registry import ALLOCATIONS


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


def check_model(args, model) -> None:
    """Raise before any work where ``model`` has no weights yet (the meta device) or the allocation cannot prune
    it at all (filter pruning without convs)."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device (e.g. {meta[:3]}): built without weights "
            "(init_empty_weights, device_map='meta'); load its weights first, e.g. with from_pretrained"
        )
    kind = ALLOCATIONS.meta(args.allocation).get("prunes")  # {} for an n:m pattern
    if kind and not any(t.kind == kind for t in prunable_tensors(model)):
        raise ValueError(
            f"allocation={args.allocation!r} prunes {kind} layers only and {type(model).__name__} has none: the run "
            "would train at sparsity 0. Use an unstructured allocation, e.g. 'global'"
        )

"""The learned soup's data in a run (docs/method.md §4): a share of the validation set split off with a fixed seed,
which only the learned soup fits on; greedy's trials, the candidates' scores and every row's validation score use
the rest. The loss is the one the replicas trained with: the model's own (transformers), the run's
``compute_loss_func``, or cross-entropy on logits."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..data import split_validation
from ..families import family_of
from ..soup.learned import FitData
from ..training.trainer import cross_entropy_loss


def split_fit_data(args, eval_dataset, model: nn.Module, collate, compute_loss_func=None):
    """``(validation for everything else, FitData or None)``: None unless ``merge_methods`` has a learned soup."""
    if "learned" not in args.merge_methods:
        return eval_dataset, None
    rest, held = split_validation(eval_dataset, args.soup_options["learned"]["fraction"])
    own = family_of(model).computes_loss and compute_loss_func is None
    loss = compute_loss_func or cross_entropy_loss

    def batch_loss(mixed: nn.Module, batch) -> torch.Tensor:
        if not isinstance(batch, Mapping):
            raise TypeError(f"the learned soup reads batches as dicts of model inputs and labels, got {type(batch)}")
        device = next(iter(mixed.parameters())).device
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if own:  # the model computes its loss from labels (seq2seq decoder inputs too)
            outputs = mixed(**inputs)
            return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
        labels = inputs.pop("labels")
        return loss(mixed(**inputs), labels)

    return rest, FitData(held, args.per_device_train_batch_size, collate, batch_loss)

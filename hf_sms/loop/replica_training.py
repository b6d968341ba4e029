"""Training one replica: the trainer run shared by every job (:meth:`hf_sms.loop.sms.SparseModelSoup.train_replica`),
and replicas that train a subset of the model (``replica_params``; :mod:`hf_sms.adapters`)."""

from __future__ import annotations

import dataclasses
import logging
import os

from safetensors.torch import load_file, save_file
from torch import nn

from ..adapters.replica import load_trained_state, make_replica, merged_copy, trained_state
from ..atomic import atomic_path
from ..checkpoint import save_sparse
from ..checkpoint.constants import SPARSITY_NAME
from ..checkpoint.folder import checkpoint_file

logger = logging.getLogger("hf_sms")
REPLICA_STATE = "replica.safetensors"  # a subset replica's trained tensors, beside its merged checkpoint


def fit(ctx, model: nn.Module, step, args, folder: str, callbacks=(), **trainer_kwargs) -> nn.Module:
    """Train ``model`` in place under ``step.masks`` with the run's trainer class, its output in ``folder``."""
    kept = sum(int(m.sum()) for m in step.masks.values()) / max(sum(m.numel() for m in step.masks.values()), 1)
    logger.info(
        "[hf-sms] %s: retraining at sparsity %.4f (seed=%s, lr=%s, wd=%s, epochs=%s, params=%s, rank %d/%d)",
        os.path.relpath(folder, ctx.args.output_dir),
        1 - kept,
        args.seed,
        args.learning_rate,
        args.weight_decay,
        args.num_train_epochs,
        getattr(args, "replica_params", "all"),
        ctx.world.rank,
        ctx.world.size,
    )
    # only the final soup is pushed; a replica data-parallel over its group of k keeps the run's batch (the paper's)
    batch = args.per_device_train_batch_size // ctx.world.group_size
    args = dataclasses.replace(args, output_dir=folder, push_to_hub=False, per_device_train_batch_size=batch)
    group = {"process_group": ctx.world.subgroup} if ctx.world.subgroup is not None else {}
    kwargs = {**ctx.trainer_kwargs, "callbacks": ctx.trainer_kwargs["callbacks"] + list(callbacks)}
    trainer = ctx.trainer_class(
        model, args, masks=step, train_dataset=ctx.train_dataset, **group, **kwargs, **trainer_kwargs
    )
    trainer.train()
    return model


def train_subset(ctx, start, step, args, name: str, keep_adapters: bool, callbacks=(), **trainer_kwargs) -> nn.Module:
    """A replica that trains ``args.replica_params`` of ``start`` (sharing the rest with it). Its folder holds the
    merged model (what ``load_sparse`` and ``hf-sms merge`` read) and the trained tensors (``replica.safetensors``,
    read on resume). Returns the replica itself with ``keep_adapters`` (soups are made from the updates), else the
    merged plain model."""
    folder = ctx.run_dir.path(name)
    path = os.path.join(folder, REPLICA_STATE)
    replica = make_replica(start, args)
    if os.path.isfile(os.path.join(folder, SPARSITY_NAME)):  # written last: the replica is complete
        logger.info("[hf-sms] %s: finished earlier, loading %s", name, path)
        if checkpoint_file(folder, REPLICA_STATE) is None:
            raise ValueError(f"{folder} holds no {REPLICA_STATE}: delete that folder to retrain the replica")
        load_trained_state(replica, load_file(path))
        return replica if keep_adapters else merged_copy(replica)
    fit(ctx, replica, step, args, folder, callbacks, **trainer_kwargs)
    merged = None if keep_adapters and not ctx.world.is_group_main else merged_copy(replica)
    if ctx.world.is_group_main:  # the tensors first: sparsity.json, written last by save_sparse, marks it done
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in trained_state(replica).items()}, tmp)
        save_sparse(merged, folder, processing_class=ctx.processing_class)
    return replica if keep_adapters else merged

"""Training one replica: the trainer run shared by every job (:meth:`hf_sms.loop.sms.SparseModelSoup.train_replica`),
and replicas that train a subset of the model (``replica_params``; :mod:`hf_sms.adapters`)."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import gc
import json
import logging
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..adapters.replica import load_trained_state, make_replica, merged_copy, trained_state
from ..atomic import atomic_path
from ..checkpoint import load_sparse
from ..checkpoint.codec import crc32
from ..checkpoint.constants import REPLICA_STATE
from ..checkpoint.folder import checkpoint_file
from ..training.sharding import shard_replica, unsharded

logger = logging.getLogger("hf_sms")


def fit(ctx, model: nn.Module, step, args, folder: str, callbacks=(), like=None, **trainer_kwargs) -> nn.Module:
    """Train ``model`` under ``step.masks`` with the run's trainer class, its output in ``folder``; returns it
    trained. With ``replica_sharding="fsdp"`` it trains sharded over its group and comes back a plain copy of
    ``like`` (:mod:`hf_sms.training.sharding`), else it is trained in place."""
    sharded = getattr(args, "replica_sharding", "none") == "fsdp" and ctx.world.subgroup is not None
    masks = step.masks.values()
    kept = sum(int(m.count_nonzero()) for m in masks) / max(sum(m.numel() for m in masks), 1)
    logger.info(
        "[hf-sms] %s: retraining at sparsity %.4f (seed=%s, lr=%s, wd=%s, %s, params=%s, rank %d/%d%s)",
        os.path.relpath(folder, ctx.args.output_dir),
        1 - kept,
        args.seed,
        args.learning_rate,
        args.weight_decay,
        f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs:g} epochs",
        getattr(args, "replica_params", "all"),
        ctx.world.rank,
        ctx.world.size,
        f", sharded over {ctx.world.group_size} processes (FSDP2)" if sharded else "",
    )
    # only the final soup is pushed; a replica data-parallel over its group of k keeps the run's batch (the paper's)
    batch = args.per_device_train_batch_size // ctx.world.group_size
    args = dataclasses.replace(args, output_dir=folder, push_to_hub=False, per_device_train_batch_size=batch)
    group = {"process_group": ctx.world.subgroup} if ctx.world.subgroup is not None else {}
    kwargs = {**ctx.trainer_kwargs, "callbacks": ctx.trainer_kwargs["callbacks"] + list(callbacks)}
    if sharded:  # FSDP2 averages the group's gradients itself (the trainer sees sharded parameters)
        model = shard_replica(model, ctx.world.subgroup, ctx.world.device)
    trainer = ctx.trainer_class(
        model, args, masks=step, train_dataset=ctx.train_dataset, **group, **kwargs, **trainer_kwargs
    )
    trainer.train()
    device = trainer.args.device  # where a replica trained without sharding would now be
    del trainer
    if sharded:
        model = unsharded(model, like, device)
    release_memory()
    trained = ((n, p) for n, p in model.named_parameters() if p.requires_grad)
    check_finite(trained, folder, "its training diverged: lower learning_rate (or lora_alpha), or clip gradients")
    return model


@dataclass(frozen=True)
class Parked:
    """A finished full replica waiting for its soup on disk, in its checkpoint folder, instead of in memory."""

    start: nn.Module
    folder: str


def park(start: nn.Module, folder: str) -> Parked:
    """Let go of a finished replica (its folder holds it, bit for bit) and hand its memory back to the system: with
    m full replicas trained in turn, the process then holds the one in training, not also the m - 1 before it
    (benchmarks/replica_memory.py). :func:`load_replica` brings it back."""
    release_memory()  # the caller dropped its last reference to the replica
    return Parked(start, folder)


def load_replica(start: nn.Module, folder: str, masks=None) -> nn.Module:
    """A finished replica: a copy of ``start`` loaded from its checkpoint ``folder``; with ``masks``, refused where it
    holds weights they prune."""
    model = copy.deepcopy(start)
    try:
        load_sparse(folder, model)
    except Exception as e:  # truncated or foreign file: say which, and how to recover
        raise ValueError(
            f"{folder} is not a readable checkpoint of this model ({e}); delete that folder to retrain the "
            "replica, or use a fresh --output_dir"
        ) from e
    check_finite(model.named_parameters(), folder, "delete that folder to retrain the replica")
    params = dict(model.named_parameters())
    revived = [n for n, m in (masks or {}).items() if bool((params[n].detach()[~m.to(params[n].device)] != 0).any())]
    if revived:  # a checkpoint trained under another mask (copied in from elsewhere)
        raise ValueError(
            f"{folder} holds weights where this phase's mask prunes them (e.g. {revived[:3]}): it was trained "
            "under another mask. Delete that folder to retrain the replica, or use a fresh --output_dir"
        )
    return model.train()


def is_on(model: nn.Module, device: torch.device) -> bool:
    """Every parameter of ``model`` on ``device`` (``cuda`` without an index: any GPU)."""
    return all(
        p.device.type == device.type and (device.index is None or p.device.index == device.index)
        for p in model.parameters()
    )


def release_memory() -> None:
    """Hand the memory a finished trainer freed (gradients, optimizer state, activations) back to the system:
    glibc keeps large freed blocks in its heap, so without this each replica's training leaves the process a
    model's worth larger or more (benchmarks/replica_memory.py). A no-op where glibc is not the allocator."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def train_subset(ctx, start, step, args, name: str, keep_adapters: bool, callbacks=(), **trainer_kwargs) -> nn.Module:
    """A replica that trains ``args.replica_params`` of ``start`` (sharing the rest with it). Its folder holds what
    it trained, ``replica.safetensors`` (written atomically: its presence marks the replica done): a replica of a
    large model costs megabytes of disk, not a model. Returns the replica itself with ``keep_adapters`` (soups are
    made from the updates), else the merged plain model (IMP's next phase starts from it)."""
    folder = ctx.run_dir.path(name)
    path = os.path.join(folder, REPLICA_STATE)
    if not is_on(start, ctx.device):  # moved in place, once: the phase's replicas then share its frozen weights
        start.to(ctx.device)  # there (the trainer's move would give each replica, and so each candidate, its own copy)
    replica = make_replica(start, args)
    retrain = f"delete {folder} to retrain the replica"
    if os.path.isfile(path):
        logger.info("[hf-sms] %s: finished earlier, loading %s", name, path)
        if checkpoint_file(folder, REPLICA_STATE) is None:
            raise ValueError(f"{path} is not a regular file inside {folder}: {retrain}")
        try:
            load_trained_state(replica, _read_state(path))
        except (ValueError, RuntimeError, OSError) as e:
            raise ValueError(f"{path} is not this replica's trained state ({e}): {retrain}") from e
    else:
        fit(ctx, replica, step, args, folder, callbacks, **trainer_kwargs)
        state = {k: v.contiguous() for k, v in trained_state(replica).items()}
        if ctx.world.is_group_main:
            with atomic_path(path) as tmp:
                crcs = json.dumps({k: crc32(v.cpu()) for k, v in state.items()})
                meta = {"format": "pt", "replica_params": args.replica_params, "crc32": crcs}
                save_file(state, tmp, metadata=meta)
    return replica if keep_adapters else merged_copy(replica)


def _read_state(path: str) -> dict[str, torch.Tensor]:
    """A finished subset replica's tensors, checked against the CRC-32 written with them (a file from before they
    were written has none) and for non-finite values."""
    with safe_open(path, "pt") as f:
        recorded = json.loads((f.metadata() or {}).get("crc32") or "{}")
        state = {k: f.get_tensor(k) for k in f.keys()}
    changed = [k for k, v in state.items() if k in recorded and crc32(v) != recorded[k]]
    if changed:
        raise ValueError(f"the bytes of {changed[:3]} are not the ones written")
    check_finite(state.items(), path, "")
    return state


def check_finite(tensors, what: str, fix: str) -> None:
    """Refuse NaN or infinity in ``tensors`` (``(name, tensor)`` pairs): a run never ends on a non-finite soup."""
    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what} holds non-finite values ({name}){': ' + fix if fix else ''}")

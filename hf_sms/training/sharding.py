"""Replicas larger than one device: models sharded by torch's FSDP2 (``fully_shard``: every parameter a
``DTensor``). Masks are placed like their weights (:func:`hf_sms.pruning.masks.placed`, used by ``apply_masks`` and
the trainer's :class:`~hf_sms.pruning.enforcement.MaskEnforcer`), soups are averaged shard by shard, and a soup is
saved from its shards, one gathered tensor at a time (docs/parallel.md, "Sharded replicas"). In an SMS run,
``replica_sharding="fsdp"`` shards each replica over its group's processes while it trains (:func:`shard_replica`)
and gathers it back (:func:`unsharded`).
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.sparse import save_sparse
from ..pruning.masks import is_sharded
from ..soup.averaging import Accumulator


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


def _blocks(module: nn.Module, names: frozenset[str]) -> Iterator[nn.Module]:
    """The outermost units sharded one at a time: transformers' ``_no_split_modules`` classes (its decoder layers,
    T5Block), else the members of every ``nn.ModuleList`` / ``nn.Sequential`` that hold parameters (timm's blocks,
    a plain model's layers); the root takes the rest."""
    for child in module.children():
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        if (type(child).__name__ in names) if names else container and any(True for _ in child.parameters()):
            yield child
        else:
            yield from _blocks(child, names)


def shard_replica(model: nn.Module, group, device: str | torch.device) -> nn.Module:
    """Shard ``model`` in place over the processes of ``group`` with FSDP2, block by block and then the root: its
    weights, gradients and optimizer state are split over them, and a block is moved to ``device`` and cut there
    one at a time (no device ever holds the whole model). Training then all-gathers a block for its forward and
    backward and reduce-scatters its gradients, averaged over the group (data-parallel over it, as a group's
    replica trains without sharding)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device_type=torch.device(device).type)
    for block in list(_blocks(model, frozenset(getattr(model, "_no_split_modules", None) or ()))):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@torch.no_grad()
def unsharded(model: nn.Module, like: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """A plain copy of ``like`` (the replica's start: the same architecture), on ``device`` (default: like's),
    holding the tensors of the sharded ``model``, gathered one at a time. Every process of the group calls it and
    gets the whole replica, which is then saved, scored and souped as any replica is: its weights must fit
    ``device``, its training (gradients, optimizer state, activations) did not have to."""
    out = copy.deepcopy(like).to(device) if device is not None else copy.deepcopy(like)
    targets = out.state_dict()
    for name, full in _gathered(model):
        targets[name].copy_(full)
    return out.train(model.training)


def local_state(model: nn.Module, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """This process's shard of every tensor of ``model`` (a copy on ``device``): what a finished sharded replica
    keeps for the soup (1 / the group's size of the model per process)."""
    return {k: _local(v).detach().to(device, copy=True) for k, v in model.state_dict().items()}


@torch.no_grad()
def sharded_soup(
    into: nn.Module, candidates: Sequence[dict[str, torch.Tensor]], weights: Sequence[float] | None = None, group=None
) -> nn.Module:
    """Set ``into`` (sharded like the candidates) to the weighted mean of ``candidates`` (their :func:`local_state`,
    ``weights`` default uniform), shard by shard through the one averaging kernel: no process ever holds a full
    model. Replicas trained by other groups of processes on the same layout add theirs with one all-reduce per
    tensor over ``group`` (the processes holding the same shard; ``weights`` then weigh every group's
    candidates, and each group passes its own). Inputs sharing a mask give a soup with that mask, bit for bit."""
    if not candidates:
        raise ValueError("nothing to soup: pass at least one candidate's local_state")
    weights = list(weights) if weights is not None else [1.0 / len(candidates)] * len(candidates)
    _check_soup_inputs(into, candidates, weights, group)  # before any shard is written
    for name, target in into.state_dict().items():
        shard = _local(target)
        acc = Accumulator(shard)
        for candidate, w in zip(candidates, weights):
            acc.add(candidate[name], w)
        if group is not None and acc.floating:
            dist.all_reduce(acc.total, group=group)
        shard.copy_(acc.result())
    return into


def _check_soup_inputs(into: nn.Module, candidates, weights: list[float], group) -> None:
    """Every candidate holds every tensor, shaped as ``into``'s shard; the weights are finite, non-negative and sum
    to 1 (over ``group`` too); the candidates share one mask (every process compares its shards, and all agree)."""
    if len(weights) != len(candidates) or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"need one finite weight >= 0 per candidate ({len(candidates)}), got {weights}")
    total, digest = torch.tensor([float(sum(weights))], dtype=torch.float64), 0
    for name, target in into.state_dict().items():
        shard = _local(target)
        for i, candidate in enumerate(candidates):
            if name not in candidate:
                raise ValueError(f"candidate {i} has no {name!r}: soup candidates of this model's local_state")
            if candidate[name].shape != shard.shape:
                raise ValueError(
                    f"{name!r}: candidate {i}'s shard is {tuple(candidate[name].shape)}, this model's "
                    f"{tuple(shard.shape)}; soup candidates sharded with the same mesh and layout as the model"
                )
        if shard.is_floating_point() and shard.dim() > 1:
            mask = candidates[0][name] != 0
            for i, candidate in enumerate(candidates[1:], 1):
                if not torch.equal(candidate[name] != 0, mask):
                    raise ValueError(
                        f"candidates {i} and 0 have different masks in {name!r}: their mean would not be sparse; "
                        "soup replicas retrained from the same pruned model"
                    )
            digest = zlib.crc32(np.packbits(mask.reshape(-1).cpu().numpy()).tobytes(), digest)  # this shard's mask
    if group is not None:  # every group's weights together, and one mask across the groups
        dist.all_reduce(total, group=group)
        low, high = torch.tensor([digest]), torch.tensor([digest])
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            raise ValueError("the groups' candidates have different masks: soup replicas of the same pruned model")
    if abs(float(total) - 1.0) > 1e-6:
        raise ValueError(f"the soup's weights sum to {float(total):g}, not 1: normalise them (over every group)")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full tensors of a sharded ``model`` on the CPU of process 0 (``None`` elsewhere), gathered one tensor at
    a time: a device never holds more than its shards and one full tensor. Every process of the mesh calls it."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    out = {name: full.detach().to("cpu", copy=True) for name, full in _gathered(model) if main}
    return out if main else None


def _gathered(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every tensor of ``model``, a sharded one gathered over its mesh when its turn comes
    (every process of the mesh iterates it alike): one full tensor at a time."""
    for name, t in model.state_dict().items():
        yield name, t.full_tensor() if is_sharded(t) else t


def full_model(model: nn.Module) -> nn.Module | None:
    """``model`` itself where it is not sharded. A transformers model sharded by FSDP2 (transformers' ``fsdp``
    arguments): on process 0 a plain model of its class, built on the ``meta`` device and given the full tensors
    gathered one at a time (:func:`full_state_dict`, on the CPU), ties tied again; ``None`` on the others. Every
    process calls it (``SparseSoupTrainer.save_model``)."""
    if not any(is_sharded(p) for p in model.parameters()):
        return model
    from torch.distributed.fsdp import FSDPModule

    plain = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses the model's
    if not hasattr(plain, "_from_config"):  # said on every process, before any of them gathers
        raise ValueError(
            f"a sharded {plain.__name__} cannot be rebuilt from a config: save it with "
            f"hf_sms.training.sharding.save_sharded(model, folder, template=<an unsharded {plain.__name__}, e.g. "
            "built on the meta device>)"
        )
    with torch.device("meta"):
        template = plain._from_config(model.config)
    full = _filled(template, model)
    if full is not None:
        full.tie_weights()  # assign=True gave each tied name its own tensor
    return full


def _filled(template: nn.Module, model: nn.Module) -> nn.Module | None:
    """``template`` holding the full tensors of the sharded ``model`` (:func:`full_state_dict`, assigned: no copy) on
    process 0, ``None`` on the others."""
    state = full_state_dict(model)
    if state is None:
        return None
    template.load_state_dict(state, assign=True)
    return template


def save_sharded(model: nn.Module, directory: str, template: nn.Module, format: str = "bitmask", **kwargs) -> None:
    """Save a sharded ``model`` as a sparse checkpoint folder (:func:`hf_sms.save_sparse`): its tensors gathered
    to process 0's CPU one at a time (:func:`full_state_dict`), set into ``template`` (an unsharded model of the
    architecture, e.g. built on the ``meta`` device: no copy is made) and written there. Every process calls it;
    they return when the folder is complete."""
    if _filled(template, model) is not None:
        save_sparse(template, directory, format, **kwargs)
    if dist.is_initialized():
        dist.barrier()

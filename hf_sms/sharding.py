"""Replicas larger than one device: models sharded by torch's FSDP2 (``fully_shard``: every parameter a
``DTensor``). Masks are placed like their weights (:func:`hf_sms.pruning.masks.placed`, used by ``apply_masks`` and
the trainer's :class:`~hf_sms.pruning.enforcement.MaskEnforcer`), soups are averaged shard by shard, and a soup is
saved from its shards, one gathered tensor at a time (docs/parallel.md, "Sharded replicas").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint.sparse import save_sparse
from .pruning.masks import is_sharded
from .soup.averaging import Accumulator


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


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
    for name, target in into.state_dict().items():
        shard = _local(target)
        acc = Accumulator(shard)
        for candidate, w in zip(candidates, weights, strict=True):
            if candidate[name].shape != shard.shape:
                raise ValueError(
                    f"{name!r}: a candidate's shard is {tuple(candidate[name].shape)}, this model's "
                    f"{tuple(shard.shape)}; soup candidates sharded with the same mesh and layout as the model"
                )
            acc.add(candidate[name], w)
        if group is not None and acc.floating:
            dist.all_reduce(acc.total, group=group)
        shard.copy_(acc.result())
    return into


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full tensors of a sharded ``model`` on the CPU of process 0 (``None`` elsewhere), gathered one tensor at
    a time: a device never holds more than its shards and one full tensor. Every process of the mesh calls it."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if is_sharded(t) else t
        if main:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out if main else None


def save_sharded(model: nn.Module, directory: str, template: nn.Module, format: str = "bitmask", **kwargs) -> None:
    """Save a sharded ``model`` as a sparse checkpoint folder (:func:`hf_sms.save_sparse`): its tensors gathered
    to process 0's CPU one at a time (:func:`full_state_dict`), set into ``template`` (an unsharded model of the
    architecture, e.g. built on the ``meta`` device: no copy is made) and written there. Every process calls it;
    they return when the folder is complete."""
    state = full_state_dict(model)
    if state is not None:
        template.load_state_dict(state, assign=True)
        save_sparse(template, directory, format, **kwargs)
    if dist.is_initialized():
        dist.barrier()

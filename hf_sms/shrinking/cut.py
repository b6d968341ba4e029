"""Cutting units out of tensors: which positions each tensor dimension keeps, and the smaller tensors, either as a
state dict (for a model its family rebuilds at the smaller widths) or in place (any model: layers are told their
new sizes)."""

from __future__ import annotations

import torch
from torch import nn

from ..pruning.units import UnitGroup

Index = dict[tuple[str, int], torch.Tensor]


def kept_index(model: nn.Module, groups: list[UnitGroup], keep: list[torch.Tensor]) -> Index:
    """``{(tensor name, dim): positions kept}`` for every tensor dimension a removed unit lies in."""
    shapes = {**{n: p.shape for n, p in model.named_parameters()}, **{n: b.shape for n, b in model.named_buffers()}}
    dropped: dict[tuple[str, int], torch.Tensor] = {}
    for group, kept in zip(groups, keep):
        if bool(kept.all()):
            continue
        for m in group.members:
            key = (m.name, m.dim)
            along = m.along(kept.cpu(), shapes[m.name][m.dim])
            dropped[key] = dropped[key] | ~along if key in dropped else ~along
    return {key: (~gone).nonzero().flatten() for key, gone in dropped.items() if gone.any()}


def _canonical(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(t), n)
    return names


def cut_tensor(tensor: torch.Tensor, name: str, index: Index) -> torch.Tensor:
    """``tensor`` (named ``name``) with only the kept positions of each dimension ``index`` names."""
    out = tensor.detach()
    for (n, dim), kept in index.items():
        if n == name:
            out = out.index_select(dim, kept.to(out.device))
    return out.clone() if out is tensor.detach() else out


def cut_state_dict(model: nn.Module, index: Index) -> dict[str, torch.Tensor]:
    """``model``'s state dict with the units cut out (tied tensors under each of their keys)."""
    names = _canonical(model)
    return {k: cut_tensor(v, names.get(id(v), k), index) for k, v in model.state_dict(keep_vars=True).items()}


def _resize(module: nn.Module, old: dict[str, torch.Size]) -> None:
    """A layer's size attributes from its (cut) tensors."""
    w = getattr(module, "weight", None)
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = w.shape
    elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        module.nf = w.shape[1]
    elif isinstance(module, nn.modules.conv._ConvNd):
        depthwise = module.groups > 1 and module.groups == module.in_channels == old["weight"][0]
        if module.transposed:
            module.in_channels, module.out_channels = w.shape[0], w.shape[1] * module.groups
        else:
            module.out_channels, module.in_channels = w.shape[0], w.shape[1] * module.groups
        if depthwise:
            module.groups = module.in_channels = module.out_channels = w.shape[0]
    elif isinstance(module, nn.modules.batchnorm._NormBase):
        module.num_features = (w if w is not None else module.running_mean).shape[0]
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = w.shape[1]
    elif isinstance(module, nn.GroupNorm):
        if module.num_groups == module.num_channels:
            module.num_groups = w.shape[0]
        module.num_channels = w.shape[0]
    elif isinstance(module, nn.LayerNorm) and w is not None:
        module.normalized_shape = tuple(w.shape)
    elif isinstance(module, nn.PReLU):
        module.num_parameters = w.shape[0]


@torch.no_grad()
def resize_to(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """``model`` with every tensor that ``shapes`` (a checkpoint's, by name) holds smaller cut to that shape, in place:
    the model a smaller checkpoint cut in place was saved from, ready to load it. Only ever smaller, dimension by
    dimension; a tensor of another rank or a larger one is left for the load to refuse."""
    index = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        stored = tuple(shapes.get(name, tensor.shape))
        if (
            len(stored) == tensor.dim()
            and stored != tuple(tensor.shape)
            and all(0 < s <= t for s, t in zip(stored, tensor.shape))
        ):
            index.update({(name, d): torch.arange(s) for d, (s, t) in enumerate(zip(stored, tensor.shape)) if s < t})
    return cut_in_place(model, index)


@torch.no_grad()
def cut_in_place(model: nn.Module, index: Index) -> nn.Module:
    """Cut ``index``'s positions out of ``model``'s parameters and buffers, in place (a tied tensor once), and
    tell every layer whose tensors changed its new sizes. Returns ``model``."""
    names, new = _canonical(model), {}
    for module in model.modules():
        old = {}
        for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            name = names.get(id(t))
            if name is None or not any(n == name for n, _ in index):
                continue
            if id(t) not in new:
                cut = cut_tensor(t, name, index)
                new[id(t)] = nn.Parameter(cut, t.requires_grad) if isinstance(t, nn.Parameter) else cut
            old[attr] = t.shape
            setattr(module, attr, new[id(t)])
        if old:
            _resize(module, old)
    return model

"""Unit groups: the n interchangeable units of one space (a conv's filters with every layer that reads them, an
FFN's neurons, an attention's heads), how masks remove whole units, and what is removed (docs/method.md §11).

A unit is a set of slices of several tensors (:class:`Member`): the rows of the layers that produce it, the columns
of the layers that read it (zeroed too, so removing it is exact whatever the channel still carries), and the
entries of biases, norms and depthwise convs that act on it (cut out by :func:`hf_sms.shrink`, masked only where
they are prunable weights). :mod:`hf_sms.pruning.graph` finds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .allocations import _keep_top, _masked_scores, _n_keep
from .prunable import Masks


@dataclass(frozen=True, eq=False)
class Member:
    """Where a group's units lie in one tensor: along ``dim``, unit ``u`` covers ``positions[u]`` (a row of
    ``k`` indices; several for a head, or a channel read from several places). ``masked``: a prunable weight the
    mask covers; else (a bias, a norm) only :func:`hf_sms.shrink` cuts it. ``role``: producer, consumer,
    channelwise or follower."""

    name: str
    dim: int
    positions: torch.Tensor
    masked: bool = True
    role: str = "follower"

    def _units(self, x: torch.Tensor) -> torch.Tensor:
        moved = x.movedim(self.dim, 0)
        return moved[self.positions.to(x.device)].reshape(self.positions.shape[0], -1)

    def unit_sums(self, scores: torch.Tensor) -> torch.Tensor:
        return self._units(scores).sum(1)

    def unit_alive(self, mask: torch.Tensor) -> torch.Tensor:
        return self._units(mask).any(1)

    def along(self, keep: torch.Tensor, size: int) -> torch.Tensor:
        """Bool per position along ``dim`` (of ``size``): False where a unit not in ``keep`` lies."""
        out = torch.ones(size, dtype=torch.bool)
        out[self.positions[~keep.cpu()].flatten()] = False
        return out

    def expand(self, keep: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``keep`` (one bool per unit) as a mask that broadcasts over a tensor of ``shape``."""
        view = [-1 if d == self.dim else 1 for d in range(len(shape))]
        return self.along(keep, shape[self.dim]).view(view)


@dataclass(frozen=True, eq=False)
class UnitGroup:
    """``n_units`` interchangeable units, each the slices of ``members`` at its index.

    Attributes:
        kind: ``"filters"``, ``"neurons"`` or ``"heads"``.
        name: where they are (the first layer producing them, and how many more).
        layers: how many layers read the units (each attention, FFN or conv consumer), for reports.
    """

    kind: str
    name: str
    n_units: int
    members: tuple[Member, ...]
    layers: int = 1
    kinds: frozenset = field(default_factory=frozenset)

    @property
    def masked(self) -> list[Member]:
        return [m for m in self.members if m.masked]

    @property
    def producers(self) -> list[Member]:
        return [m for m in self.members if m.role == "producer"]


def keep_count(n_units: int, sparsity: float, alive: int, multiple_of: int = 1) -> int:
    """Units a group of ``n_units`` keeps at ``sparsity`` (never more than are ``alive``), rounded up to a multiple
    of ``multiple_of`` where that does not keep more than are alive."""
    n = _n_keep(n_units, sparsity, alive)
    if multiple_of > 1:
        rounded = math.ceil(n / multiple_of) * multiple_of
        n = rounded if rounded <= alive else n
    return n


def unit_masks(
    groups: list[UnitGroup],
    scores: dict[str, torch.Tensor],
    masks: Masks,
    sparsity: float,
    multiple_of: int = 1,
    own_kernels: bool = True,
) -> Masks:
    """Masks removing ``round(sparsity * n)`` units of every group (more if earlier masks removed more; removed
    units stay removed), those whose weights score lowest in total; with ``multiple_of``, each group keeps a
    multiple of it (the next best units stay). Weights outside every group keep their masks.

    ``own_kernels``: a filter's score is that of its own kernel(s), the producing layers' slices (Li et al. 2017,
    the paper; several producers tied by a residual stream: their kernels together); ``False``: of every weight of
    the unit, readers included. Neurons and heads always score every weight of the unit. Either way every masked
    slice of a removed unit is zeroed.

    Raises ``ValueError`` where a group would keep no unit.
    """
    out = dict(masks)
    for g in groups:
        masked = g.masked
        alive = torch.stack([m.unit_alive(masks[m.name]).cpu() for m in masked]).any(0)
        n_keep = keep_count(g.n_units, sparsity, int(alive.sum()), multiple_of)
        if n_keep < 1:
            raise ValueError(
                f"sparsity {sparsity:g} removes every one of the {g.n_units} {g.kind} of {g.name}; a layer needs at "
                f"least one: use a sparsity below {1 - 0.5 / g.n_units:.4g}"
            )
        scored = [m for m in masked if m.role == "producer"] if own_kernels and g.kind == "filters" else []
        total = sum(m.unit_sums(scores[m.name]).cpu().double() for m in scored or masked)
        keep = _keep_top(_masked_scores(total, alive), n_keep)
        for m in masked:
            out[m.name] = out[m.name] & m.expand(keep, out[m.name].shape).to(out[m.name].device)
    return out


@torch.no_grad()
def removed_units(model: nn.Module, group: UnitGroup) -> torch.Tensor:
    """Bool per unit of ``group``: True where every masked weight of the unit is exactly zero."""
    alive = [m.unit_alive(model.get_parameter(m.name).detach() != 0).cpu() for m in group.masked]
    return ~torch.stack(alive).any(0)


def unit_report(model: nn.Module, groups: list[UnitGroup]) -> dict:
    """``{kind: {"sparsity", "removed", "units"}}``: the fraction of each kind of unit that is entirely zero,
    counted per layer that reads them."""
    report: dict[str, dict] = {}
    for g in groups:
        entry = report.setdefault(g.kind, {"removed": 0, "units": 0})
        entry["removed"] += int(removed_units(model, g).sum()) * g.layers
        entry["units"] += g.n_units * g.layers
    for entry in report.values():
        entry["sparsity"] = entry["removed"] / max(entry["units"], 1)
    return report

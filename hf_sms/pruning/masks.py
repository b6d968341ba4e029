"""Masks, phase targets and the pruning step (docs/method.md §1-§3).

A mask is a plain ``bool`` tensor per parameter name, ``True`` where the weight is kept. Which weights are
prunable lives in :mod:`hf_sms.pruning.prunable`, how sparsity is spread over them in
:mod:`hf_sms.pruning.allocations`, and which masks a run computes in :mod:`hf_sms.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .bits import unpack_bits
from .prunable import Masks, PrunableTensor, prunable_tensors
from .selection import ModuleSelection


def check_sparsity(sparsity: float) -> None:
    if not (isinstance(sparsity, (int, float)) and 0.0 <= sparsity < 1.0):
        raise ValueError(f"sparsity must be a fraction in [0, 1), got {sparsity!r}; e.g. 0.9 removes 90% of weights")


def validate_masks(model: nn.Module, masks: Masks) -> dict[str, PrunableTensor]:
    """Check that every mask names a prunable parameter of ``model`` with the same shape."""
    tensors = {t.name: t for t in prunable_tensors(model)}
    for name, mask in masks.items():
        if name not in tensors:
            hint = ", ".join(list(tensors)[:5])
            raise ValueError(
                f"mask names {name!r}, which is not a prunable weight of this model; prunable weights are e.g. "
                f"{hint}. Compute masks with hf_sms.compute_masks(model, ...) on the same architecture."
            )
        if tuple(mask.shape) != tuple(tensors[name].param.shape):
            raise ValueError(
                f"mask for {name!r} has shape {tuple(mask.shape)} but the weight has shape "
                f"{tuple(tensors[name].param.shape)}; the masks belong to a different architecture."
            )
        if mask.dtype != torch.bool:
            raise ValueError(f"mask for {name!r} has dtype {mask.dtype}; masks are bool tensors (True = kept)")
    return tensors


def is_sharded(t: torch.Tensor) -> bool:
    """A tensor of a model sharded by FSDP2 (a ``DTensor``), without importing torch.distributed."""
    return type(t).__name__ == "DTensor"


def placed(mask: torch.Tensor, param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mask`` where ``param`` lives: on its device and, for a parameter sharded by FSDP2 (a ``DTensor``), sharded
    like it (its mesh and placements; each process cuts its own shard of the full mask, no communication)."""
    if is_sharded(param) and not is_sharded(mask):
        from torch.distributed.tensor import distribute_tensor

        mask = distribute_tensor(mask.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return mask.to(device=param.device, dtype=dtype or mask.dtype)


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Masks) -> nn.Module:
    """Zero the pruned weights of ``model`` in place (FSDP2-sharded weights shard by shard); returns ``model``."""
    tensors = validate_masks(model, masks)
    for name, mask in masks.items():
        param = tensors[name].param
        param.masked_fill_(~placed(mask, param), 0.0)  # +0.0, not the -0.0 a multiply leaves
    return model


def masks_from_model(model: nn.Module) -> Masks:
    """Masks read off the zeros of the prunable weights (a weight that is exactly 0 counts as pruned)."""
    return {t.name: t.param.detach() != 0 for t in prunable_tensors(model)}


class PackedMasks(Mapping):
    """Masks held as bits (one bit a weight: a sixteenth of a bf16 model's bytes), each unpacked to a bool tensor
    when asked for: what a pruning step computes for a whole model before it is applied and measured."""

    def __init__(self, names, shapes, packed):
        self.names, self.shapes, self.packed = list(names), dict(zip(names, shapes)), dict(zip(names, packed))

    def __getitem__(self, name: str) -> torch.Tensor:
        return unpack_bits(self.packed[name], self.shapes[name])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class WeightZeros(Mapping):
    """The masks of a pruned model read off its weights' zeros when asked for (``{name: weight != 0}``), never held.
    Where training never moves a pruned weight's zero, nor a kept one to zero (subset replicas: the weights are
    frozen, a MaskLoRA update is gated by them), these are the run's masks exactly, for none of the memory a bool
    tensor per weight takes (a quarter of a model's float32 bytes, half its bfloat16 ones)."""

    def __init__(self, model: nn.Module, names):
        tensors = {t.name: t.param for t in prunable_tensors(model)}
        self._params = {n: tensors[n] for n in names}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._params[name].detach() != 0

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


@torch.no_grad()
def sparsity_report(model: nn.Module, masks: Masks | None = None, tensors=None) -> dict:
    """Measured sparsity: fraction of exact zeros in the weights a plan prunes (``tensors``; default: every
    prunable weight, a causal LM's decoder linears: :mod:`hf_sms.pruning.selection`), globally and per tensor.

    Units removed (filters, neurons, heads) are the plan's to say (:meth:`hf_sms.plan.PruningPlan.achieved`). If
    ``masks`` is given, also reports the mask's sparsity, so the two can be compared.
    """
    per_tensor, zeros, numel = {}, 0, 0
    for t in ModuleSelection().tensors(model) if tensors is None else tensors:
        z = t.param.numel() - int(torch.count_nonzero(t.param))  # no int64 copy, as (x == 0).sum() makes
        per_tensor[t.name] = {"sparsity": z / t.param.numel(), "zeros": z, "numel": t.param.numel()}
        zeros, numel = zeros + z, numel + t.param.numel()
    report = {"sparsity": zeros / max(numel, 1), "zeros": zeros, "numel": numel, "per_tensor": per_tensor}
    all_params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in all_params)
    report["model_sparsity"] = 1 - sum(int(torch.count_nonzero(p)) for p in all_params) / max(total, 1)
    if masks is not None:
        pruned = sum(m.numel() - int(torch.count_nonzero(m)) for m in masks.values())
        report["mask_sparsity"] = pruned / max(sum(m.numel() for m in masks.values()), 1)
    return report


def phase_sparsities(target: float, n_phases: int) -> list[float]:
    """Sparsity after each of ``n_phases`` IMP phases reaching ``target`` (docs/method.md §1).

    Each phase removes the same fraction ``q = 1 - (1 - target) ** (1 / n_phases)`` of the weights
    still alive: ``phase_sparsities(0.9, 3)`` is about ``[0.536, 0.785, 0.9]``.
    """
    check_sparsity(target)
    if not isinstance(n_phases, int) or n_phases < 1:
        raise ValueError(f"n_phases must be a positive integer, got {n_phases!r}")
    q = 1.0 - (1.0 - target) ** (1.0 / n_phases)
    # the last exactly the target, not 1 - (1 - q)**P with rounding error; none before it above it (a tiny target's
    # rounding could put one 1e-16 over, and sparsities only grow)
    return [min(1.0 - (1.0 - q) ** p, float(target)) for p in range(1, n_phases)] + [float(target)]


@torch.no_grad()
def pruned_norm_fraction(model: nn.Module, masks: Masks) -> float:
    """``d = sqrt(|‖θ‖² - ‖θ_pruned‖²|) / ‖θ‖`` for pruning ``model`` with ``masks`` (ALLR, docs/method.md §3).

    Norms run over all parameters (weights and biases); ``model`` is the model before pruning.
    """
    tensors = validate_masks(model, masks)
    total = sum(_squares(p) for p in {id(p): p for p in model.parameters()}.values())
    removed = sum(_squares(tensors[n].param, m) for n, m in masks.items())
    return math.sqrt(removed) / math.sqrt(total) if total > 0 else 0.0


def _squares(weight: torch.Tensor, keep: torch.Tensor | None = None, chunk: int = 1 << 20) -> float:
    """The sum of squares of ``weight`` (where ``keep`` is False, if given), in float64 a chunk at a time."""
    w = weight.detach().reshape(-1)
    k = keep.to(weight.device).reshape(-1) if keep is not None else None
    total = 0.0
    for i in range(0, w.numel(), chunk):
        part = w[i : i + chunk].double().square_()
        total += float((part.masked_fill_(k[i : i + chunk], 0) if k is not None else part).sum())
    return total


@dataclass
class PruningStep:
    """The masks of one pruning step plus what ALLR needs to know about it.

    Attributes:
        masks: ``{name: bool tensor}``, True where kept.
        norm_fraction: d, relative norm of the weights this step removed.
        phase_fraction: q, fraction of the then-alive prunable weights this step removed.
    """

    masks: Masks
    norm_fraction: float
    phase_fraction: float

    @classmethod
    @torch.no_grad()
    def measure(cls, model: nn.Module, masks: Masks) -> PruningStep:
        """Describe pruning ``model`` (not yet masked) with ``masks``."""
        tensors = validate_masks(model, masks)
        alive = newly = 0
        for name, mask in masks.items():
            nz = tensors[name].param.detach() != 0
            alive += int(torch.count_nonzero(nz))  # bool sum() would upcast to an int64 copy
            newly += int(torch.count_nonzero(nz & ~mask.to(nz.device)))
        return cls(masks, pruned_norm_fraction(model, masks), newly / alive if alive else 0.0)

"""Magnitude pruning: masks, phase targets and the pruning step (docs/method.md §1-§3).

A mask is a plain ``bool`` tensor per parameter name, ``True`` where the weight is kept. Which weights are
prunable lives in :mod:`hf_sms.pruning.prunable`, how sparsity is spread over them in :mod:`hf_sms.pruning.allocations`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..registry import ALLOCATIONS, CRITERIA, STRUCTURES
from .allocations import get_allocation, n_of_m, parse_n_of_m
from .criteria import CriterionContext, criterion_scores
from .prunable import Masks, PrunableTensor, call_order_uses, prunable_tensors
from .structured import filter_sparsity
from .structures import NOfM, is_unit_structure, unit_masks


def _check_sparsity(sparsity: float) -> None:
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


@dataclass(frozen=True)
class Pruning:
    """What a pruning step does, as three independent choices (docs/method.md §2, §11): the ``criterion`` scores
    every weight (``CRITERIA``), the ``structure`` says which weights fall together (``STRUCTURES``), the
    ``allocation`` spreads the sparsity over layers (``ALLOCATIONS``)."""

    allocation: str = "global"
    structure: str = "unstructured"
    criterion: str = "magnitude"


def resolve_pruning(
    allocation: str | None = None, structure: str | None = None, criterion: str | None = None
) -> Pruning:
    """The :class:`Pruning` these names ask for, checked; ``ValueError`` for a name or a combination that does not
    exist, before any work.

    ``None`` takes the default: ``"global"`` allocation for unstructured pruning and ``"uniform"`` for units,
    ``"magnitude"`` criterion, ``"unstructured"`` structure. The names hf-sms had before structures keep working:
    ``allocation="filter_l2"`` is ``structure="filters", criterion="l2", allocation="uniform"`` (``filter_l1``
    likewise), ``allocation="2:4"`` is ``structure="2:4"``.
    """
    legacy = ALLOCATIONS.meta(allocation) if isinstance(allocation, str) else {}
    if parse_n_of_m(allocation) is not None:
        legacy = {"structure": allocation}
    for key, given in (("structure", structure), ("criterion", criterion)):
        if key in legacy and given is not None and given != legacy[key]:
            raise ValueError(
                f"allocation={allocation!r} means {key}={legacy[key]!r}; it cannot go with {key}={given!r}"
            )
    if "structure" in legacy:
        allocation, structure = legacy.get("allocation", "uniform"), legacy["structure"]
        criterion = criterion or legacy.get("criterion")
    structure, criterion = structure or "unstructured", criterion or "magnitude"
    STRUCTURES.get(structure)
    CRITERIA.get(criterion)
    units = is_unit_structure(structure)
    allocation = allocation or ("uniform" if units else "global")
    get_allocation(allocation)
    if units and allocation != "uniform":
        raise ValueError(
            f"structure={structure!r} removes the same fraction of units from every layer, so the smaller model "
            f"still fits its family's config (one d_ff, one num_heads): use allocation='uniform', not {allocation!r}"
        )
    return Pruning(allocation, structure, criterion)


@torch.no_grad()
def compute_masks(
    model: nn.Module,
    sparsity: float,
    allocation: str | None = None,
    masks: Masks | None = None,
    example_inputs=None,
    *,
    structure: str | None = None,
    criterion: str | None = None,
    seed: int = 0,
) -> Masks:
    """Pruning masks for ``model`` at ``sparsity``: ``criterion`` x ``structure`` x ``allocation``.

    Args:
        model: any torch model; prunable tensors are found by :func:`prunable_tensors`.
        sparsity: unstructured: the fraction in [0, 1) of all prunable weights removed (tied weights counted once);
            units: the fraction of units removed from every group (each FFN's neurons, each conv's filters).
        allocation: a name in ``ALLOCATIONS`` ("global", "uniform", "uniform_plus", "erk", "lamp"); default
            "global" (units: "uniform", the only one whose smaller model fits the family's config). The older
            names "filter_l2", "filter_l1" and "n:m" (e.g. "2:4") still work (see :func:`resolve_pruning`).
        masks: masks of an earlier phase; weights they prune stay pruned (masks only grow).
        example_inputs: optional batch (see :func:`call_order_uses`); with it, one forward pass orders the
            layers by call, so "first conv" and "last linear" (``uniform_plus``) mean execution order; criteria
            that read activations (``"wanda"``) need it.
        structure: a name in ``STRUCTURES``: "unstructured" (default), "filters", "neurons", "heads", "n:m", or
            several units joined by "+" ("neurons+heads").
        criterion: a name in ``CRITERIA``: "magnitude" (default), "l1", "l2", "random", "wanda".
        seed: the random stream of criteria that need one; the same seed gives the same masks.

    Returns:
        ``{parameter name: bool tensor}`` on the weights' devices, ``True`` where the weight is kept.
        Exactly ``round(sparsity * n)`` weights (or units) are pruned per allocation unit unless earlier masks
        already prune more.
    """
    _check_sparsity(sparsity)
    spec = resolve_pruning(allocation, structure, criterion)
    tensors = list(validate_masks(model, masks or {}).values())
    if not tensors:
        raise ValueError("model has no prunable weights (linear, convolution or embedding layers)")
    if example_inputs is not None:
        uses = call_order_uses(model, example_inputs)
        tensors = [replace(t, uses=tuple(uses.get(id(t.param), ()))) for t in tensors]
    current = {t.name: torch.ones_like(t.param, dtype=torch.bool) for t in tensors}
    current.update({n: m.to(current[n].device) for n, m in (masks or {}).items()})
    weights = {t.name: t.param.detach().float() * current[t.name] for t in tensors}
    scores = criterion_scores(spec.criterion, tensors, weights, CriterionContext(model, example_inputs, seed))
    finder = STRUCTURES.get(spec.structure)
    if isinstance(finder, NOfM):
        return n_of_m(tensors, scores, current, float(sparsity), n=finder.n, m=finder.m)
    if spec.structure == "unstructured":
        return get_allocation(spec.allocation)(tensors, scores, current, float(sparsity))
    groups = finder(model, tensors)
    if not groups:
        raise ValueError(
            f"structure={spec.structure!r} finds no units in {type(model).__name__} (no "
            f"{STRUCTURES.meta(spec.structure).get('prunes', 'matching')} layers of a kind it knows): pruning would "
            "remove nothing. Choose a structure the model has, or 'unstructured'"
        )
    return unit_masks(groups, scores, current, float(sparsity))


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Masks) -> nn.Module:
    """Zero the pruned weights of ``model`` in place; returns ``model``."""
    tensors = validate_masks(model, masks)
    for name, mask in masks.items():
        param = tensors[name].param
        param.masked_fill_(~mask.to(param.device), 0.0)  # +0.0, not the -0.0 a multiply leaves
    return model


def masks_from_model(model: nn.Module) -> Masks:
    """Masks read off the zeros of the prunable weights (a weight that is exactly 0 counts as pruned)."""
    return {t.name: t.param.detach() != 0 for t in prunable_tensors(model)}


@torch.no_grad()
def sparsity_report(model: nn.Module, masks: Masks | None = None) -> dict:
    """Measured sparsity: fraction of exact zeros in the prunable weights, globally and per tensor.

    ``report["filters"]`` is the structured view (Li et al. 2017, docs/method.md §2): the fraction of conv output
    filters that are entirely zero, overall and per conv weight (:func:`hf_sms.pruning.structured.filter_sparsity`).
    If ``masks`` is given, also reports the mask's sparsity, so the two can be compared.
    """
    per_tensor, zeros, numel = {}, 0, 0
    for t in prunable_tensors(model):
        z = int((t.param == 0).sum())
        per_tensor[t.name] = {"sparsity": z / t.param.numel(), "zeros": z, "numel": t.param.numel()}
        zeros, numel = zeros + z, numel + t.param.numel()
    report = {"sparsity": zeros / max(numel, 1), "zeros": zeros, "numel": numel, "per_tensor": per_tensor}
    all_params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in all_params)
    report["model_sparsity"] = sum(int((p == 0).sum()) for p in all_params) / max(total, 1)
    report["filters"] = filter_sparsity(model)
    if masks is not None:
        pruned = sum(int((~m).sum()) for m in masks.values())
        report["mask_sparsity"] = pruned / max(sum(m.numel() for m in masks.values()), 1)
    return report


def phase_sparsities(target: float, n_phases: int) -> list[float]:
    """Sparsity after each of ``n_phases`` IMP phases reaching ``target`` (docs/method.md §1).

    Each phase removes the same fraction ``q = 1 - (1 - target) ** (1 / n_phases)`` of the weights
    still alive: ``phase_sparsities(0.9, 3)`` is about ``[0.536, 0.785, 0.9]``.
    """
    _check_sparsity(target)
    if not isinstance(n_phases, int) or n_phases < 1:
        raise ValueError(f"n_phases must be a positive integer, got {n_phases!r}")
    q = 1.0 - (1.0 - target) ** (1.0 / n_phases)
    out = [1.0 - (1.0 - q) ** p for p in range(1, n_phases + 1)]
    out[-1] = float(target)  # exact, not 1 - (1 - q)**P with rounding error
    return out


@torch.no_grad()
def pruned_norm_fraction(model: nn.Module, masks: Masks) -> float:
    """``d = sqrt(|‖θ‖² - ‖θ_pruned‖²|) / ‖θ‖`` for pruning ``model`` with ``masks`` (ALLR, docs/method.md §3).

    Norms run over all parameters (weights and biases); ``model`` is the model before pruning.
    """
    tensors = validate_masks(model, masks)
    total = sum(float(p.detach().float().pow(2).sum()) for p in {id(p): p for p in model.parameters()}.values())
    removed = sum(
        float(tensors[n].param.detach().float().pow(2)[~m.to(tensors[n].param.device)].sum()) for n, m in masks.items()
    )
    return math.sqrt(removed) / math.sqrt(total) if total > 0 else 0.0


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
            alive += int(nz.sum())
            newly += int((nz & ~mask.to(nz.device)).sum())
        return cls(masks, pruned_norm_fraction(model, masks), newly / alive if alive else 0.0)


def prune(
    model: nn.Module,
    sparsity: float,
    allocation: str | None = None,
    masks: Masks | None = None,
    sync: Callable[[Masks], Masks] | None = None,
    example_inputs=None,
    *,
    structure: str | None = None,
    criterion: str | None = None,
    seed: int = 0,
) -> PruningStep:
    """Compute masks for ``sparsity``, measure the step for ALLR, and zero the pruned weights in place.

    ``sync`` replaces the computed masks before use, e.g. with rank 0's masks in a distributed run.
    ``allocation``, ``example_inputs``, ``structure``, ``criterion``, ``seed``: as in :func:`compute_masks`.
    """
    new = compute_masks(
        model, sparsity, allocation, masks, example_inputs, structure=structure, criterion=criterion, seed=seed
    )
    step = PruningStep.measure(model, sync(new) if sync is not None else new)
    apply_masks(model, step.masks)
    return step

"""The pruning choice, resolved once: ``criterion`` x ``structure`` x ``allocation`` as one :class:`PruningPlan`
(docs/method.md §2, §11), and the functions that prune with it."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..pruning.allocations import get_allocation, parse_n_of_m
from ..pruning.criteria import CriterionContext, criterion_scores
from ..pruning.masks import PruningStep, apply_masks, check_sparsity, validate_masks
from ..pruning.prunable import Masks, PrunableTensor, call_order_uses, check_weights_loaded
from ..pruning.selection import ModuleSelection
from ..pruning.top_k import LazyMapping
from ..registry import ALLOCATIONS, CRITERIA
from .structures import Final, Structure, get_structure

logger = logging.getLogger("hf_sms")


def _pruned_zeros(weight: torch.Tensor, padding_idx: int | None) -> int:
    """The zeros of ``weight`` that say a model was pruned: not those a model has unpruned (an embedding's
    padding row, as BERT's; a zero-initialised tensor, which pruning never makes: it refuses to empty a layer)."""
    nonzero = weight != 0
    if not nonzero.any():
        return 0
    zeros = weight.numel() - int(nonzero.sum())
    if padding_idx is not None:
        zeros -= int((~nonzero[padding_idx]).sum())
    return zeros


@dataclass(frozen=True)
class PruningPlan:
    """What every pruning step of a run does: the ``criterion`` scores every weight (``CRITERIA``), the
    ``structure`` says which weights fall together (``STRUCTURES``, configured with the run's choices: for units
    ``unit_multiple`` and ``fit_config``), the ``allocation`` spreads the sparsity over them (``ALLOCATIONS``).
    ``seed``: the stream of a criterion that needs one."""

    allocation: str = "global"
    structure: Structure = None
    criterion: str = "magnitude"
    seed: int = 0
    modules: ModuleSelection = ModuleSelection()

    @property
    def units(self) -> str:
        """What a target sparsity counts: ``"weights"`` or ``"units"``."""
        return self.structure.units

    @property
    def cuts_units(self) -> bool:
        """Whole units are pruned: the final soup is a smaller model (the plan's word for it, asked nowhere else)."""
        return self.units == "units"

    def describe(self) -> dict:
        """The plan as names (run folders, sparsity.json, the card)."""
        out = {"allocation": self.allocation, "structure": self.structure.name, "criterion": self.criterion}
        out.update(self.modules.describe())
        if self.units == "units":
            out.update(unit_multiple=self.structure.unit_multiple, fit_config=self.structure.fit_config)
        return out

    @torch.no_grad()
    def masks(self, model: nn.Module, sparsity: float, masks: Masks | None = None, example_inputs=None) -> Masks:
        """Masks for ``model`` at ``sparsity`` (see :func:`compute_masks`)."""
        check_sparsity(sparsity)
        check_weights_loaded(model)  # the reason, not torch's "Cannot copy out of meta tensor"
        validate_masks(model, masks or {})
        tensors = self.tensors(model)
        if not tensors:
            raise ValueError("model has no prunable weights (linear, convolution or embedding layers)")
        for t in tensors:  # NaN ranks above every weight: the masks would be wrong, and the run would blame training
            flat = t.param.detach().reshape(-1)
            if any(not bool(torch.isfinite(chunk).all()) for chunk in flat.split(1 << 24)):
                raise ValueError(
                    f"{t.name} holds NaN or infinite values before pruning: the model arrived broken (check how it "
                    "was loaded or trained); magnitudes of non-finite weights cannot be ranked"
                )
        if example_inputs is not None:
            uses = call_order_uses(model, example_inputs)
            tensors = [replace(t, uses=tuple(uses.get(id(t.param), ()))) for t in tensors]
        given, params = masks or {}, {t.name: t.param for t in tensors}

        def current_mask(name: str) -> torch.Tensor:
            p = params[name]
            return given[name].to(p.device) if name in given else torch.ones_like(p, dtype=torch.bool)

        @functools.cache
        def zero_where_pruned(name: str) -> bool:
            return name not in given or _zero_where_pruned(params[name], current_mask(name))

        def weight(name: str) -> torch.Tensor:  # the weight itself in float32 (no copy) where its pruned entries are 0
            w = params[name].detach().float()
            return w if zero_where_pruned(name) else w * current_mask(name)

        # Made as they are read, one tensor at a time: a model's masks (a quarter of its fp32 bytes) and, for a
        # bf16 model, its float32 weights (twice its bytes) are never held at once (the criteria may hold scores).
        def stored(name: str) -> torch.Tensor:  # no float32 copy: an elementwise criterion converts chunk by chunk
            return params[name].detach() if zero_where_pruned(name) else weight(name)

        current, weights = LazyMapping(params, current_mask), LazyMapping(params, weight, LazyMapping(params, stored))
        context = CriterionContext(model, example_inputs, self.seed)
        scores = criterion_scores(self.criterion, tensors, weights, context)
        new = self.structure.masks(model, tensors, scores, current, float(sparsity), example_inputs)
        extra = [n for n in given if n not in new]  # masks only grow, selected or not
        return {**{n: given[n] for n in extra}, **new} if extra else new

    def tensors(self, model: nn.Module) -> list[PrunableTensor]:
        """The prunable weights this plan prunes in ``model`` (:mod:`hf_sms.pruning.selection`)."""
        return self.modules.tensors(model)

    def prune(
        self,
        model: nn.Module,
        sparsity: float,
        masks: Masks | None = None,
        example_inputs=None,
        sync: Callable[[Masks], Masks] | None = None,
    ) -> PruningStep:
        """Compute masks, measure the step for ALLR, and zero the pruned weights in place; ``sync`` replaces the
        masks before use (rank 0's in a distributed run)."""
        new = self.masks(model, sparsity, masks, example_inputs)
        step = PruningStep.measure(model, sync(new) if sync is not None else new)
        apply_masks(model, step.masks)
        return step

    def arriving(self, model: nn.Module, target: float, adapted: bool, example: Callable) -> PruningStep:
        """The masks of a model a trainer is given without any: a model that arrives with zeros keeps them. With
        adapters (passed in, or added by the trainer class: trl's ``peft_config``) it trains under them, whatever
        ``target`` says; without, it is pruned further only to a higher ``target``. Pruning an unpruned model, or
        a pruned one further, is said in the log. ``example()``: a batch, if the plan needs one."""
        tensors = self.tensors(model)
        padding = {id(m.weight): m.padding_idx for m in model.modules() if isinstance(m, nn.Embedding)}
        zeros = sum(_pruned_zeros(t.param.detach(), padding.get(id(t.param))) for t in tensors)
        now = zeros / max(sum(t.param.numel() for t in tensors), 1)
        if now > 0 and (adapted or target <= now + 1e-6):
            if abs(target - now) > 0.005:
                logger.warning(
                    "[hf-sms] the model arrives %.1f%% pruned%s: training under its zeros, not at target_sparsity=%g "
                    "(prune it first, e.g. hf_sms.prune(model, %g), then add the adapters)",
                    100 * now,
                    " with adapters" if adapted else "",
                    target,
                    target,
                )
            return PruningStep.measure(model, {t.name: t.param.detach() != 0 for t in tensors})
        (logger.warning if now > 0 else logger.info)(  # a second pruning is never silent
            "[hf-sms] pruning the model%s from %.1f%% to target_sparsity=%g (%s)",
            " under its adapters" if adapted else "",
            100 * now,
            target,
            self.structure.name,
        )
        return self.prune(model, target, example_inputs=example())

    def validate(self, target: float) -> None:
        """Refuse a run's target this plan cannot reach (an n:m pattern has one sparsity), before any model."""
        self.structure.validate(target)

    def preview(self, model: nn.Module, target: float, example_inputs) -> Final | None:
        """What the final soup would be saved as if ``model`` were pruned to ``target`` once now (its units are
        chosen by training, their numbers are not); ``None`` where the final soup keeps the model's shapes."""
        if not self.cuts_units:
            return None
        pruned = copy.deepcopy(model)
        self.prune(pruned, target, example_inputs=example_inputs)
        return self.structure.final(pruned, model, example_inputs)

    def check(self, model: nn.Module, target: float, example_inputs=None) -> None:
        """Refuse, before any work, a model this plan prunes nothing of (or would empty a layer of)."""
        self.structure.check(model, target, example_inputs)

    def rounding(self, model: nn.Module, masks: Masks, example_inputs=None) -> int:
        """How many weights a step may prune beyond its target by rounding (per tensor, or per group of units)."""
        return self.structure.rounding(model, masks, example_inputs)

    def achieved(self, model: nn.Module, example_inputs=None) -> dict:
        """``{kind: fraction removed}`` of the units this plan prunes (``{}`` for weight structures)."""
        return self.structure.achieved(model, example_inputs)

    def final(self, soup: nn.Module, dense: nn.Module, example_inputs) -> Final:
        """What the run's final soup is saved as (the smaller model for units)."""
        return self.structure.final(soup, dense, example_inputs)

    def timed(self, model: nn.Module, example_inputs) -> dict:
        """``model`` timed dense against its sparse runtime or its smaller model, on the device it is on."""
        return self.structure.timed(model, example_inputs)


@torch.no_grad()
def _zero_where_pruned(weight: torch.Tensor, keep: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether ``weight`` is exactly zero wherever ``keep`` is False (a chunk at a time: no copy of the weight)."""
    w, k = weight.detach().reshape(-1), keep.reshape(-1)
    return not any(bool(w[i : i + chunk].masked_select(~k[i : i + chunk]).any()) for i in range(0, w.numel(), chunk))


def resolve_pruning(
    allocation: str | None = None,
    structure=None,
    criterion: str | None = None,
    seed: int = 0,
    unit_multiple: int = 1,
    fit_config: bool = True,
    prune_modules=None,
    skip_modules=None,
) -> PruningPlan:
    """The :class:`PruningPlan` these names ask for, checked; ``ValueError`` for a name or a combination that does
    not exist, before any work.

    ``None`` takes the default: ``"global"`` allocation for weights and ``"uniform"`` for units, criterion
    ``"magnitude"`` for weights and ``"l2"`` for units (Li et al. 2017; the paper: "we adopt the L2-norm
    criterion"), structure ``"unstructured"``. The names hf-sms had before structures keep working:
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
    found = get_structure(structure if structure is not None else "unstructured")
    criterion = criterion or found.default_criterion
    CRITERIA.get(criterion)
    per_layer = CRITERIA.meta(criterion).get("per_layer", False)  # its scores are comparable within a layer only
    allocation = allocation or ("uniform" if per_layer else found.default_allocation)
    get_allocation(allocation)
    if per_layer and allocation == "global":
        raise ValueError(
            f"criterion={criterion!r} scores scale with each layer's inputs, so one global threshold removes whole "
            "layers (an embedding, o_proj, down_proj: 100% pruned); compare within each layer as its paper does: "
            "allocation='uniform' (the default for it), or 'erk' / 'uniform_plus'"
        )
    if isinstance(unit_multiple, bool) or not isinstance(unit_multiple, int) or unit_multiple < 1:
        raise ValueError(f"unit_multiple={unit_multiple!r} must be a positive integer (e.g. 8)")
    structure = found.configured(allocation, criterion, unit_multiple, fit_config)
    return PruningPlan(allocation, structure, criterion, seed, ModuleSelection.of(prune_modules, skip_modules))


@torch.no_grad()
def compute_masks(
    model: nn.Module,
    sparsity: float,
    allocation: str | None = None,
    masks: Masks | None = None,
    example_inputs=None,
    *,
    structure=None,
    criterion: str | None = None,
    seed: int = 0,
    unit_multiple: int = 1,
    fit_config: bool = True,
    prune_modules=None,
    skip_modules=None,
) -> Masks:
    """Pruning masks for ``model`` at ``sparsity``: ``criterion`` x ``structure`` x ``allocation``.

    Args:
        model: any torch model; prunable tensors are found by :func:`hf_sms.prunable_tensors`.
        sparsity: weights: the fraction in [0, 1) of all prunable weights removed (tied weights counted once);
            units: the fraction of units removed from every group (each conv's filters with every layer reading
            them, each FFN's neurons, each attention's heads).
        allocation: a name in ``ALLOCATIONS`` ("global", "uniform", "uniform_plus", "erk", "lamp"); default
            "global" (units: "uniform", the only one whose smaller model fits the family's config). The older
            names "filter_l2", "filter_l1" and "n:m" (e.g. "2:4") still work (see :func:`resolve_pruning`).
        masks: masks of an earlier phase; weights they prune stay pruned (masks only grow).
        example_inputs: a batch (see :func:`hf_sms.pruning.prunable.call_order_uses`); with it, one forward pass
            orders the layers by call ("first conv" and "last linear" of ``uniform_plus``); criteria that read
            activations (``"wanda"``) need it; units are found by tracing it (a transformers, timm or smp model
            makes its own when it is not given).
        structure: a name in ``STRUCTURES``: "unstructured" (default), "filters", "neurons", "heads", "n:m", or
            units joined by "+" ("neurons+heads").
        criterion: a name in ``CRITERIA``: "magnitude" (default for weights), "l1", "l2" (default for units; a
            filter by its own kernel), "l2_group" / "l1_group" (a filter with its readers' slices), "random", "wanda".
        seed: the random stream of criteria that need one; the same seed gives the same masks.
        unit_multiple: units: every group keeps a multiple of this many (the next best units stay).
        fit_config: units: prune only units the model family's own config can state, so :func:`hf_sms.shrink`
            gives a model its library loads by itself; False: every unit the graph has.
        prune_modules, skip_modules: the modules to prune and those to leave dense, in the form of peft's
            ``target_modules`` (names or their last parts, e.g. ``["q_proj", "v_proj"]``, or one regular expression
            as a string). Default: every prunable weight; a causal LM's decoder linear layers (its embeddings and
            ``lm_head`` stay dense, as Wanda and SparseGPT leave them). :mod:`hf_sms.pruning.selection`.

    Returns:
        A ``dict`` ``{parameter name: bool tensor}`` on the weights' devices, ``True`` where the weight is kept
        (yours to edit: a run holds them as bits internally, :class:`hf_sms.pruning.masks.PackedMasks`).
        Exactly ``round(sparsity * n)`` weights (or units) are pruned per allocation unit unless earlier masks
        already prune more.
    """
    plan = resolve_pruning(
        allocation, structure, criterion, seed, unit_multiple, fit_config, prune_modules, skip_modules
    )
    if plan.cuts_units and unit_multiple > 1:  # a multiple that keeps every unit: refused here too, as a run does
        plan.structure.check_multiple(plan.structure.groups(model, example_inputs), sparsity)
    return dict(plan.masks(model, sparsity, masks, example_inputs).items())


def prune(
    model: nn.Module,
    sparsity: float,
    allocation: str | None = None,
    masks: Masks | None = None,
    sync: Callable[[Masks], Masks] | None = None,
    example_inputs=None,
    **pruning,
) -> PruningStep:
    """Compute masks for ``sparsity``, measure the step for ALLR, and zero the pruned weights in place.

    ``sync`` replaces the computed masks before use, e.g. with rank 0's masks in a distributed run. ``allocation``,
    ``example_inputs`` and the keyword arguments (``structure``, ``criterion``, ``seed``, ...): as in
    :func:`compute_masks`.
    """
    return resolve_pruning(allocation, **pruning).prune(model, sparsity, masks, example_inputs, sync)

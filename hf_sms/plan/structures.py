"""Structures: which weights fall together when a model is pruned (docs/method.md §2, §11). One object each, in
``STRUCTURES``, with one interface: what a pruning step masks, what a run must refuse before it starts, what a
pruned model has achieved, what its final soup is saved as, and how it is timed. The run asks its structure and
never which kind it is.

- ``"unstructured"``: every weight on its own (the paper's IMP).
- ``"n:m"`` (e.g. ``"2:4"``): ``n`` of every ``m`` consecutive input weights of a linear layer.
- ``"filters"``, ``"neurons"``, ``"heads"``, or several joined by ``"+"``: whole units, found from the model's
  graph (:mod:`hf_sms.pruning.graph`); the final soup is the smaller model (:func:`hf_sms.shrink`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from torch import nn

from ..checkpoint.shrink_record import PRUNED, ShrinkRecord
from ..families import family_of
from ..pruning.allocations import get_allocation, n_of_m, parse_n_of_m
from ..pruning.graph import trace_units
from ..pruning.prunable import Masks, PrunableTensor, prunable_tensors
from ..pruning.units import UnitGroup, keep_count, unit_masks, unit_report
from ..registry import ALLOCATIONS, CRITERIA, STRUCTURES
from ..runtime.speed import measure_speedup_of, time_smaller
from ..shrinking.shrink import KINDS, example_batch, shrink, shrink_record
from .unit_groups import same_in_train_mode, stated_groups, tell_once

logger = logging.getLogger("hf_sms")


@dataclass(frozen=True)
class Final:
    """What a final soup's folder holds: ``model`` in ``fmt`` (``"bitmask"`` or the family's own ``"dense"``),
    and ``shrunk``: what :func:`hf_sms.shrink` made of it (``None`` for weight structures)."""

    model: nn.Module
    fmt: str
    shrunk: ShrinkRecord | None = None


class Structure:
    """How weights fall together, configured for one run (:meth:`configured`, from
    :func:`~hf_sms.plan.resolve_pruning`'s names). ``units``: what ``target_sparsity`` counts, ``"weights"`` or
    ``"units"``; ``default_criterion`` and ``default_allocation``: what a plan takes where none is named."""

    name = "unstructured"
    units = "weights"
    default_criterion, default_allocation = "magnitude", "global"
    spread = "global"  # the allocation that spreads the sparsity over the weights

    def configured(self, allocation: str, criterion: str, unit_multiple: int = 1, fit_config: bool = True):
        """This structure with a run's choices (a copy: registered structures stay as registered)."""
        self.check_allocation(allocation)
        new = copy.copy(self)
        new.spread = allocation
        return new

    def check_allocation(self, allocation: str) -> None:
        """Refuse an allocation this structure cannot use (any, here)."""

    def masks(self, model, tensors: list[PrunableTensor], scores, current: Masks, sparsity, batch) -> Masks:
        return get_allocation(self.spread)(tensors, scores, current, sparsity)

    def validate(self, target: float) -> None:
        """Refuse a run configuration this structure cannot do (before any model is seen)."""

    def check(self, model: nn.Module, target: float, batch) -> None:
        """Refuse, before any work, a model this structure prunes nothing of."""

    def achieved(self, model: nn.Module, batch) -> dict:
        """``{kind: fraction of those units removed}`` (``{}`` where units are not what is pruned)."""
        return {}

    def rounding(self, model: nn.Module, masks: Masks, batch) -> int:
        """How many weights a pruning step may remove beyond its target by rounding: one per tensor."""
        return len(masks)

    def final(self, soup: nn.Module, dense: nn.Module, batch) -> Final:
        return Final(soup, "bitmask")

    def timed(self, model: nn.Module, batch) -> dict:
        """``model`` timed dense against what makes it faster here (the sparse runtime, or the smaller model)."""
        return measure_speedup_of(model, batch)


class Unstructured(Structure):
    """Every weight on its own (the paper's IMP)."""


@dataclass(frozen=True, eq=False)
class NOfM(Structure):
    """``n`` of every ``m`` consecutive input weights of a linear layer (``"2:4"``, torch's semi-structured)."""

    n: int
    m: int

    @property
    def name(self) -> str:
        return f"{self.n}:{self.m}"

    def configured(self, allocation, criterion, unit_multiple=1, fit_config=True):
        return self  # the pattern is the allocation

    def masks(self, model, tensors, scores, current, sparsity, batch):
        return n_of_m(tensors, scores, current, sparsity, n=self.n, m=self.m)

    def validate(self, target):
        if abs(target - (1 - self.n / self.m)) > 1e-9:
            raise ValueError(
                f"structure={self.name!r} prunes linear weights to exactly {1 - self.n / self.m:g}: set "
                f"target_sparsity={1 - self.n / self.m:g}"
            )

    def check(self, model, target, batch):
        if not any(
            t.kind == "linear" and t.param.dim() == 2 and t.param.shape[0 if t.transposed else 1] % self.m == 0
            for t in prunable_tensors(model)
        ):
            raise ValueError(
                f"structure={self.name!r} prunes linear layers whose input size is a multiple of {self.m}, and "
                f"{type(model).__name__} has none: the run would train at sparsity 0"
            )


class Units(Structure):
    """Whole units of ``kinds`` (``filters``, ``neurons``, ``heads``), found from the model's graph; every group
    loses the same fraction (uniform allocation), so the smaller model keeps one width per config field."""

    units = "units"
    default_criterion, default_allocation = "l2", "uniform"  # Li et al. 2017, the paper's filter norm
    unit_multiple, fit_config, own_kernels = 1, True, True

    def __init__(self, kinds: tuple[str, ...], optional: tuple[str, ...] = ()):
        self.kinds, self.optional = tuple(kinds), tuple(optional)
        self.name = "+".join(k + "?" * (k in self.optional) for k in self.kinds)

    def configured(self, allocation, criterion, unit_multiple=1, fit_config=True):
        """With ``unit_multiple`` (each group keeps a multiple of it), ``fit_config`` (prune the units the family's
        config can state) and the criterion's unit score (a filter by its own kernels, or with its readers')."""
        new = super().configured(allocation, criterion)
        new.unit_multiple, new.fit_config = unit_multiple, bool(fit_config)
        new.own_kernels = CRITERIA.meta(criterion).get("unit_score", "own") == "own"
        return new

    def check_allocation(self, allocation):
        if allocation != "uniform":
            raise ValueError(
                f"structure={self.name!r} removes the same fraction of units from every layer, so the smaller model "
                f"still fits its family's config (one d_ff, one num_heads): use allocation='uniform', not "
                f"{allocation!r}"
            )

    def groups(self, model: nn.Module, batch, fit_config: bool | None = None) -> list[UnitGroup]:
        """The unit groups of ``model`` this structure prunes: with ``fit_config`` (default: the structure's), those
        its family's config can state (a model smaller in its own format), else every one the graph has."""
        fit_config = self.fit_config if fit_config is None else fit_config
        if not self._layers(model):
            return []
        groups = same_in_train_mode(model, example_batch(model, batch), self.kinds)
        if not fit_config or not groups:
            return groups
        stated = stated_groups(model, example_batch(model, batch), groups, self.kinds)
        left = [g.name for g, ok in zip(groups, stated) if not ok]
        tell_once(
            model,
            left,
            "fit_config=True leaves %d of %d %s groups dense, since %s's config cannot state their "
            "widths: %s. Reported unit fractions count every unit; fit_config=False prunes them too (a smaller model "
            "cut in place, saved with a plain route)." + family_of(model).fit_hint(model).replace("%", "%%"),
            len(left),
            len(groups),
            "/".join(self.kinds),
            type(model).__name__,
        )
        return [g for g, ok in zip(groups, stated) if ok]

    def masks(self, model, tensors, scores, current, sparsity, batch):
        groups = self.groups(model, batch)
        selected = {t.name for t in tensors}
        skipped = [g for g in groups if any(m.name not in selected for m in g.masked)]
        if skipped:  # a unit is cut in every layer that holds it: one the selection leaves dense keeps its units
            layers = ", ".join(sorted({m.name for g in skipped for m in g.masked if m.name not in selected})[:4])
            groups = [g for g in groups if g not in skipped]
            if not groups:
                raise ValueError(
                    f"structure={'+'.join(self.kinds)!r}: every group of units is also read or made by a layer that "
                    f"prune_modules / skip_modules leave dense ({layers}), so none can be cut: prune those layers "
                    "too, or prune weights (structure='unstructured')"
                )
            message = f"%d %s groups stay dense: {layers} (left dense by prune_modules / skip_modules) hold their "
            tell_once(model, [g.name for g in skipped], message + "units: %s", len(skipped), "/".join(self.kinds))
        if not groups:
            raise ValueError(self.nothing(model, batch))
        return unit_masks(groups, scores, current, sparsity, self.unit_multiple, own_kernels=self.own_kernels)

    def _layers(self, model: nn.Module) -> list[str]:
        """The layers that could make units of these kinds: convs for filters, linear (and 1x1) layers else."""
        kinds = {"conv"} if self.kinds == ("filters",) else {"linear", "conv"}
        return [t.name for t in prunable_tensors(model) if t.kind in kinds]

    def nothing(self, model: nn.Module, batch) -> str:
        """Why this structure finds nothing to prune in ``model``: every layer looked at, and why each was skipped."""
        if not self._layers(model):
            layers = "convolution" if self.kinds == ("filters",) else "linear or convolution"
            return (
                f"structure={self.name!r} finds no units in {type(model).__name__}: the run would train at sparsity "
                f"0 (it has no {layers} layers). Choose a structure the model has, or 'unstructured'"
            )
        trace = trace_units(model, example_batch(model, batch))
        found = trace.groups(self.kinds)
        other = sorted({k for f in trace.found for k in f.kinds} - set(self.kinds))
        lines = [f"{layer}: {why}" for layer, why in list(trace.skipped.items())[:8]]
        if found and self.fit_config:
            family = family_of(model)
            lines.insert(
                0,
                f"{len(found)} groups of {self.name}, but {type(model).__name__}'s {family.library} "
                "config cannot state fewer of them (e.g. a head size derived from hidden size / heads); "
                "fit_config=False prunes them for a smaller model cut in place",
            )
        elif other:
            lines.insert(0, f"it has units of {', '.join(other)}")
        more = f" (and {len(trace.skipped) - 8} more)" if len(trace.skipped) > 8 else ""
        return (
            f"structure={self.name!r} finds no units in {type(model).__name__}: the run would train at sparsity 0. "
            f"Layers looked at{more}:\n  " + "\n  ".join(lines or ["no linear or convolution layer"])
        )

    def check(self, model, target, batch):
        groups = self.groups(model, batch)
        if not groups:
            raise ValueError(self.nothing(model, batch))
        self._check_kinds(model, batch, groups)
        for g in groups:
            if keep_count(g.n_units, target, g.n_units) < 1:
                raise ValueError(
                    f"target_sparsity={target:g} removes all {g.n_units} {g.kind} of {g.name}; a layer keeps at "
                    f"least one: use a target below {1 - 0.5 / g.n_units:.4g}"
                )
        self.check_multiple(groups, target)

    def check_multiple(self, groups, target: float) -> None:
        """Refuse a ``unit_multiple`` that keeps every unit of every group at ``target``; warn where it keeps some
        groups whole."""
        whole = [g for g in groups if keep_count(g.n_units, target, g.n_units, self.unit_multiple) >= g.n_units]
        if whole and self.unit_multiple > 1:  # rounding up to the multiple keeps every unit of these groups
            names = ", ".join(f"{g.name} ({g.n_units} {g.kind})" for g in whole[:4]) + (
                " ..." if len(whole) > 4 else ""
            )
            if len(whole) == len(groups):
                raise ValueError(
                    f"unit_multiple={self.unit_multiple} keeps every unit of every group at target_sparsity={target:g} "
                    f"(the run would train at sparsity 0): {names}. Use a unit_multiple below the groups' sizes (or 1)"
                )
            kept = f"{len(whole)} of {len(groups)} groups"
            logger.warning("[hf-sms] unit_multiple=%d keeps every unit of %s: %s", self.unit_multiple, kept, names)

    def _check_kinds(self, model, batch, groups) -> None:
        """A requested kind no group can take is refused (``neurons+heads`` on a model whose config cannot state its
        heads would prune neurons only), unless marked optional (``neurons+heads?``); a kind the config states only
        in part is logged."""
        if len(self.kinds) < 2:
            return  # a single kind with no group is refused by nothing()
        found = trace_units(model, example_batch(model, batch)).groups(self.kinds)
        for kind in self.kinds:
            kept, there = sum(g.kind == kind for g in groups), sum(g.kind == kind for g in found)
            if kept == 0 and kind not in self.optional:
                why = "its config cannot state fewer of them" if there else "the model has none"
                raise ValueError(
                    f"structure={self.name!r}: {type(model).__name__} has no {kind} this run can prune ({why}), so it "
                    f"would prune {'+'.join(k for k in self.kinds if k != kind)} only. Use structure="
                    f"{'+'.join(k for k in self.kinds if k != kind)!r}, allow it with structure="
                    f"{'+'.join(k + '?' * (k == kind) for k in self.kinds)!r}, or fit_config=False (a smaller model "
                    "cut in place)"
                )
            if 0 < kept < there:
                why = "the config states only those"
                logger.warning(
                    "[hf-sms] structure=%r prunes %d of the %d groups of %s (%s)", self.name, kept, there, kind, why
                )

    def rounding(self, model, masks, batch):
        """One unit's weights per group (the allocation rounds per group)."""
        groups = [g for g in self.groups(model, batch) if all(m.name in masks for m in g.masked)]
        return sum(max(1, sum(masks[m.name].numel() for m in g.masked) // g.n_units) for g in groups) or len(masks)

    def achieved(self, model, batch):
        """The fraction of every unit of each kind the graph finds that is removed; where ``fit_config`` left
        groups dense, also of the groups pruned (``"filters in pruned groups"``)."""
        every = self.groups(model, batch, fit_config=False)
        out = {k: v["sparsity"] for k, v in unit_report(model, every).items()}
        pruned = self.groups(model, batch)
        if len(pruned) < len(every):
            out.update({f"{k} in pruned groups": v["sparsity"] for k, v in unit_report(model, pruned).items()})
        return out

    def final(self, soup, dense, batch):
        """The soup cut to its smaller model (its family's own format where its config states the widths, else
        hf-sms's); the pruned soup where nothing can be cut, saying why."""
        try:
            smaller = shrink(soup, batch, structure=self, fit_config=self.fit_config, multiple_of=self.unit_multiple)
        except (NotImplementedError, ValueError) as e:
            why = f"hf_sms.shrink could not make it smaller ({str(e)[:200]})"
            return Final(soup, "bitmask", ShrinkRecord(PRUNED, why=why))
        record = shrink_record(dense, soup, smaller, self, batch)
        removed = 1 - (record.parameter_ratio or 1)
        if self.fit_config and removed < 0.1:  # e.g. an smp model whose named encoder its config does not state
            logger.warning(
                "[hf-sms] the smaller model removes %.1f%% of the parameters: fit_config=True prunes only the units "
                "%s's config can state; fit_config=False prunes every unit (a smaller model cut in place, saved "
                "with a plain route)",
                100 * removed,
                type(soup).__name__,
            )
        return Final(smaller, "dense", record)

    def timed(self, model, batch):
        smaller = shrink(model, batch, structure=self, fit_config=self.fit_config, multiple_of=self.unit_multiple)
        return time_smaller(copy.deepcopy(model), smaller, batch)


def _parse(name):
    if not isinstance(name, str):
        return None
    nm = parse_n_of_m(name)
    if nm is not None:
        return NOfM(*nm)
    if "+" in name:  # "neurons+heads?": heads where the model has them (a kind marked ? may find no groups)
        parts = [p.strip() for p in name.split("+")]
        kinds = [p.removesuffix("?") for p in parts]
        if any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds) or all(p.endswith("?") for p in parts):
            raise ValueError(f"structure={name!r} joins unit structures, each once, e.g. 'neurons+heads'")
        return Units(tuple(kinds), optional=tuple(k for k, p in zip(kinds, parts) if p.endswith("?")))
    return None


STRUCTURES.parse = _parse
STRUCTURES.add("unstructured", Unstructured())
for _kind in KINDS:
    STRUCTURES.add(_kind, Units((_kind,)))


def _former_name(p: int):
    def allocate(tensors, scores, masks, sparsity):
        raise ValueError(
            f"allocation='filter_l{p}' means structure='filters', criterion='l{p}': pass it to "
            "compute_masks or SparseSoupConfig, which resolve it"
        )

    allocate.__doc__ = f"The former name of structure='filters', criterion='l{p}' (Li et al. 2017)."
    return allocate


# The names filter pruning had before structures: still allocations, resolved to what they mean.
ALLOCATIONS.add("filter_l2", _former_name(2), structure="filters", criterion="l2", prunes="conv")
ALLOCATIONS.add("filter_l1", _former_name(1), structure="filters", criterion="l1", prunes="conv")


def get_structure(name) -> Structure:
    """The structure ``name`` (a registered name, ``"n:m"``, units joined by ``"+"``, or a :class:`Structure`)."""
    if isinstance(name, Structure):
        return name
    if not isinstance(name, str):
        raise ValueError(f"structure={name!r} must be a name, e.g. 'unstructured', 'neurons' or 'neurons+heads'")
    return STRUCTURES.get(name)

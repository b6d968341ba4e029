"""Which smaller model a family's own config can state (docs/method.md §11): the knob values, and the units each
group keeps for them.

A counting knob (a transformers config's ``intermediate_size``, ``num_attention_heads``) is set to the units kept,
the same for every group it counts (a group that removed fewer sets the count; the others keep some of their
removed, all-zero units too). Other knobs (timm's ``base_width``, ``mlp_ratio``; smp's decoder channels) are
searched for the smallest model in which every layer keeps at least the units it needs, built on the meta device
to read its widths. Units no knob can drop stay as the zeros they are, which changes no output. Every choice is
checked against the shapes the family really builds.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..families import Family, Knob, family_of
from ..pruning.units import UnitGroup

_LARGEST = 1 << 14
_BUILDS: dict = {}  # per model architecture: {knob values: shapes built}


@dataclass
class Fit:
    """What a family can state: ``overrides`` (knob values of the smaller model), per group the units it keeps
    (``keep``; all of them where no knob states the group: ``stated`` is False)."""

    overrides: dict
    keep: list[torch.Tensor]
    stated: list[bool]


def tensor_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """``{name: shape}`` of every parameter and buffer, tied ones under their first name."""
    shapes: dict[str, torch.Size] = {}
    seen: set[int] = set()
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            shapes[n] = t.shape
    return shapes


def cut_shapes(dense: dict, groups: list[UnitGroup], keep: list[torch.Tensor]) -> dict[str, tuple]:
    """The shapes ``dense`` has once the units ``keep`` leaves are cut out."""
    out = {n: list(s) for n, s in dense.items()}
    dropped: dict[tuple[str, int], torch.Tensor] = {}
    for g, kept in zip(groups, keep):
        for m in g.members:
            if m.name in dense:
                key = (m.name, m.dim)
                gone = ~m.along(kept, dense[m.name][m.dim])
                dropped[key] = dropped[key] | gone if key in dropped else gone
    for (name, dim), gone in dropped.items():
        out[name][dim] -= int(gone.sum())
    return {n: tuple(s) for n, s in out.items()}


def pad(kept: torch.Tensor, count: int) -> torch.Tensor:
    """``kept`` with removed units added back, lowest first, until ``count`` stay."""
    kept = kept.clone()
    missing = count - int(kept.sum())
    if missing > 0:
        kept[(~kept).nonzero().flatten()[:missing]] = True
    return kept


def _built(family: Family, model: nn.Module, overrides: dict, cache: dict) -> dict | None:
    key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
    if key not in cache:
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a value too small to build says so; the search refuses it
                cache[key] = tensor_shapes(family.build(model, overrides))
        except Exception:  # noqa: BLE001 - a value the constructor refuses (timm's BasicBlock: base_width 64 only)
            cache[key] = None
    return cache[key]


def _producer(group: UnitGroup, dense: dict):
    """A producer member of ``group`` and how many positions of its dimension each unit covers."""
    for m in group.producers:
        if m.name in dense:
            return m, m.positions.shape[1]
    return None, 1


def _counting(family, model, knobs, groups, keep, multiple_of, dense, cache, overrides, stated, final):
    """Set counting knobs (transformers' FFN width, head counts). Knobs that count the same groups (LLaMA's query
    and key/value head counts) change together; the groups they count keep one number of units."""
    values = family.values(model)
    # every group of a kind, those that removed nothing too: one count sizes them all
    todo = {i for i in range(len(groups)) if not stated[i]}
    if all(bool(keep[i].all()) for i in todo):
        return
    components: list[dict] = []
    # a field left None (GPT-2's n_inner: 4 x hidden) counts what the model has; it is tried after set fields
    ordered = sorted(knobs, key=lambda k: values.get(k.name) is None)
    claimed: set[int] = set()
    for knob in ordered:
        value = values.get(knob.name, 0)
        if not knob.counts or (value is not None and not (isinstance(value, int) and value > 0)):
            continue
        mine = {i for i in todo if groups[i].kind == knob.kind and (value is None or value % groups[i].n_units == 0)}
        if value is None:
            mine -= claimed
            value = max((groups[i].n_units for i in mine), default=0)
        exact = {i for i in mine if groups[i].n_units == value}
        mine = exact or mine  # intermediate_size counts the FFNs, not a pooler whose width divides it
        if not mine or len({groups[i].n_units for i in mine}) != 1:
            continue
        claimed |= mine
        component = {"knobs": [(knob.name, value)], "groups": mine}
        for other in [c for c in components if c["groups"] & mine]:
            components.remove(other)
            component["knobs"] += other["knobs"]
            component["groups"] |= other["groups"]
        components.append(component)
    for component in components:
        members = sorted(component["groups"])
        if all(bool(keep[i].all()) for i in members):
            continue
        sizes = {groups[i].n_units for i in members}
        if len(sizes) != 1:
            continue
        n = sizes.pop()
        count = max(int(keep[i].sum()) for i in members)
        count = min(math.ceil(count / multiple_of) * multiple_of, n)
        chosen = {name: value // n * count for name, value in component["knobs"]}
        trial = list(final)
        for i in members:
            trial[i] = pad(keep[i], count)
        built = _built(family, model, {**overrides, **chosen}, cache)
        expected = cut_shapes(dense, groups, trial)
        touched = {m.name for i in members for m in groups[i].members}
        if built is not None and all(tuple(built.get(t, ())) == expected[t] for t in touched if t in expected):
            overrides.update(chosen)
            for i in members:
                final[i], stated[i] = trial[i], True


def _search_value(fits, knob: Knob, dense_value) -> float | int | None:
    """The smallest (``wider``) or largest value of ``knob`` for which ``fits`` holds, or None."""
    if knob.ratio:
        hi = float(dense_value) if isinstance(dense_value, (int, float)) and dense_value else 4.0
        if not fits(hi):
            return None
        lo = 0.0
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi
    lo, hi = 0, 1
    while hi < _LARGEST and fits(hi) != knob.wider:
        lo, hi = hi, hi * 2
    if hi >= _LARGEST:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) != knob.wider else (lo, mid)
    value = hi if knob.wider else lo
    return value if value > 0 and fits(value) else None


def _search_elements(fits, knob: Knob, values: list) -> tuple | None:
    """A tuple knob (timm ResNet's ``channels``) searched one element after the other."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    for j in range(len(values)):
        found = _search_value(lambda v, j=j: fits(tuple([*values[:j], v, *values[j + 1 :]])), knob, values[j])
        if found is not None:
            values[j] = found
    return tuple(values)


def _searched(family, model, knobs, groups, keep, multiple_of, dense, cache, overrides, stated, final):
    """Search width knobs (timm, smp) for the smallest model holding every layer's kept units."""
    todo = [i for i, g in enumerate(groups) if not stated[i] and not bool(keep[i].all())]
    need = {}
    for i in todo:
        member, k = _producer(groups[i], dense)
        if member is not None:
            count = min(math.ceil(int(keep[i].sum()) / multiple_of) * multiple_of, groups[i].n_units)
            need[(member.name, member.dim)] = dense[member.name][member.dim] - (groups[i].n_units - count) * k
    if not need:
        return
    values, kinds = family.values(model), {groups[i].kind for i in todo}
    touched = {m.name for i in todo for m in groups[i].members}
    for knob in knobs:
        if knob.counts or knob.kind not in kinds:
            continue

        def fits(value, knob=knob):
            built = _built(family, model, {**overrides, knob.name: value}, cache)
            if built is None or built.keys() != dense.keys():
                return False
            if any(built[n] != dense[n] for n in dense if n not in touched):
                return False  # a layer no removed unit lies in must keep its width
            return all(need[key] <= built[key[0]][key[1]] <= dense[key[0]][key[1]] for key in need)

        start = values.get(knob.name) if values.get(knob.name) is not None else family.default(model, knob)
        if isinstance(start, (tuple, list)):  # one value per stage: each searched with the others where they are
            value = _search_elements(fits, knob, list(start))
            for j in range(len(start) if value is not None else 0):  # a stage no weight depends on keeps its value
                kept = (*value[:j], start[j], *value[j + 1 :])
                if _built(family, model, {**overrides, knob.name: kept}, cache) == _built(
                    family, model, {**overrides, knob.name: value}, cache
                ):
                    value = kept
        else:
            value = _search_value(fits, knob, start)
        if value is not None and _built(family, model, {**overrides, knob.name: value}, cache) != _built(
            family, model, overrides, cache
        ):
            overrides[knob.name] = value  # a value that changes nothing is not written
    built = _built(family, model, overrides, cache)
    if built is None:
        return
    for i in todo:
        member, k = _producer(groups[i], dense)
        if member is None:
            continue
        fewer = dense[member.name][member.dim] - built[member.name][member.dim]
        if fewer > 0 and fewer % k == 0 and int(keep[i].sum()) <= groups[i].n_units - fewer // k:
            final[i], stated[i] = pad(keep[i], groups[i].n_units - fewer // k), True


def states_itself(model: nn.Module) -> bool:
    """Whether ``model``'s family builds a model of exactly its shapes from its own config (a smaller model cut to
    widths its config states), rather than one only a cut in place has."""
    family = family_of(model)
    return _built(family, model, {}, _cache(family, model)) == tensor_shapes(model)


def cut_unstated(model: nn.Module) -> bool:
    """Whether ``model`` is smaller than what its family builds from its own config, tensor by tensor (the same
    tensors, none larger, some smaller): a smaller model cut in place, which only a record of the cut rebuilds."""
    family = family_of(model)
    built, shapes = _built(family, model, {}, _cache(family, model)), tensor_shapes(model)
    if built is None or built.keys() != shapes.keys() or built == shapes:
        return False
    return all(len(shapes[k]) == len(b) and all(s <= t for s, t in zip(shapes[k], b)) for k, b in built.items())


def _cache(family, model: nn.Module) -> dict:
    """The builds of ``model``'s family for its config (they depend on the config, not the weights)."""
    key = (type(model).__qualname__, repr(family.values(model)), tuple(tensor_shapes(model).items()))
    cache = _BUILDS.setdefault(key, {})
    if len(_BUILDS) > 8:
        _BUILDS.pop(next(iter(_BUILDS)))
    return cache


def _states_none(groups: list[UnitGroup]) -> Fit:
    """A fit that writes no width into the config: every group keeps its units."""
    return Fit({}, [torch.ones(g.n_units, dtype=torch.bool) for g in groups], [False] * len(groups))


def fit(model: nn.Module, groups: list[UnitGroup], keep: list[torch.Tensor], multiple_of: int = 1) -> Fit | None:
    """The smaller model ``model``'s family can state with the units ``keep`` leaves (each group keeping a multiple
    of ``multiple_of``), or ``None`` where the family rebuilds nothing (plain torch). Groups no knob states keep
    every unit."""
    family = family_of(model)
    cache = _cache(family, model)  # a run fits twice
    if _built(family, model, {}, cache) is None:
        return None
    hooked = [n or type(model).__name__ for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:  # a model rebuilt from its config runs none of them: it would compute something else
        warnings.warn(
            f"forward hooks on {', '.join(hooked[:4])}{' ...' if len(hooked) > 4 else ''}: a model rebuilt from its "
            "config would not run them, so no width is written into the config; fit_config=False cuts the units in "
            "place, hooks kept",
            stacklevel=3,
        )
        return _states_none(groups)
    dense = tensor_shapes(model)
    if _built(family, model, {}, cache) != dense:
        return _states_none(groups)
    knobs = [k for k in family.knobs if family.accepts(model, k)]
    overrides: dict = {}
    stated = [False] * len(groups)
    final = [torch.ones(g.n_units, dtype=torch.bool) for g in groups]
    args = (family, model, knobs, groups, keep, multiple_of, dense, cache, overrides, stated, final)
    _counting(*args)
    _searched(*args)
    built = _built(family, model, overrides, cache)
    if built is None or {n: tuple(s) for n, s in built.items()} != cut_shapes(dense, groups, final):
        return _states_none(groups)
    return Fit(overrides, final, stated)

"""Which unit groups a unit structure prunes (:class:`hf_sms.plan.structures.Units`): those a train-mode trace finds
alike, and those the smaller model can drop, by its family's config or cut in place; what is left dense is said once
per architecture."""

from __future__ import annotations

import copy
import logging
import warnings

import torch
from torch import nn

from ..families import family_of
from ..pruning.graph import trace_units
from ..pruning.graph.trace import architecture_key
from ..pruning.units import UnitGroup
from ..shrinking.cut import cut_in_place, kept_index
from ..shrinking.fit import fit
from ..shrinking.shrink import eval_output

logger = logging.getLogger("hf_sms")

_STATED: dict = {}


def _group_key(g: UnitGroup) -> tuple:
    members = sorted((m.name, m.dim, m.role, tuple(m.positions.flatten().tolist())) for m in g.members)
    return g.kind, g.n_units, tuple(members)


def same_in_train_mode(model: nn.Module, batch, kinds) -> list[UnitGroup]:
    """The unit groups of the eval-mode trace that a train-mode trace finds alike: a unit whose channels also reach
    code only training runs (an auxiliary head, a train-only branch) is refused (left dense), naming its layer,
    before any training. A model that cannot run the batch in train mode (BatchNorm on one example) keeps eval's."""
    groups = trace_units(model, batch).groups(kinds)
    try:
        train = {_group_key(g) for g in trace_units(model, batch, train=True).groups(kinds)}
    except ValueError:
        return groups
    left = [g.name for g in groups if _group_key(g) not in train]
    tell_once(
        model,
        left,
        "%s: %d unit group(s) are read by code only training runs, which an eval-mode forward does not "
        "show, so they stay dense: %s",
        type(model).__name__,
        len(left),
    )
    return [g for g in groups if _group_key(g) in train]


_TOLD: set = set()  # the groups left dense, said once per architecture and process


def tell_once(model: nn.Module, left: list[str], message: str, *args) -> None:
    """Log ``message`` (its last ``%s``: the first names in ``left``) once per architecture and list of groups."""
    key = (architecture_key(model), message, tuple(left))
    if left and key not in _TOLD:
        _TOLD.add(key)
        logger.warning("[hf-sms] " + message, *args, ", ".join(left[:6]))


def stated_groups(model: nn.Module, batch, groups: list[UnitGroup], kinds) -> list[bool]:
    """Per group, whether the smaller model can drop its units: its family's config states them (:func:`fit` on
    half of every group), or, for a model no config rebuilds (or whose config states none of them), cutting half of
    every group of its kind in place keeps the outputs (a plain ``nn.MultiheadAttention`` cannot lose heads: its
    head size is ``embed_dim / num_heads``). Remembered per :func:`~hf_sms.pruning.graph.trace.architecture_key`."""
    key = (architecture_key(model), tuple(kinds))
    if key not in _STATED:
        if len(_STATED) > 16:
            _STATED.pop(next(iter(_STATED)))
        probe = [torch.arange(g.n_units) < max(1, g.n_units // 2) for g in groups]  # half of each group
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = fit(model, groups, probe)
        # a config that states none of them is no config for these units: cut in place, saved with a plain route
        by_config = found is not None and any(found.stated)
        _STATED[key] = found.stated if by_config else _cuttable(model, batch, groups, probe)
        if found is not None and not by_config and any(_STATED[key]):
            logger.warning(
                "[hf-sms] %s's %s config states none of its %s widths: every unit the graph finds is pruned, and "
                "the smaller model is cut in place and saved with the plain route that loads it without hf-sms "
                "(timm's pruned.txt, else a torch.export program; the save says which)",
                type(model).__name__,
                family_of(model).library,
                "/".join(kinds),
            )
    return _STATED[key]


@torch.no_grad()
def _cuttable(model: nn.Module, batch, groups: list[UnitGroup], probe: list[torch.Tensor]) -> list[bool]:
    """Per group: whether cutting half of every group of its kind in place keeps ``model``'s outputs."""
    ok = {}
    for kind in dict.fromkeys(g.kind for g in groups):
        chosen = [i for i, g in enumerate(groups) if g.kind == kind]
        pruned = copy.deepcopy(model).eval()
        params = dict(pruned.named_parameters())
        for i in chosen:
            for m in groups[i].masked:
                params[m.name].mul_(m.expand(probe[i], params[m.name].shape).to(params[m.name].device))
        index = kept_index(pruned, [groups[i] for i in chosen], [probe[i] for i in chosen])
        try:
            smaller = cut_in_place(copy.deepcopy(pruned), index)
            expected, got = eval_output(pruned, batch), eval_output(smaller, batch)
            ok[kind] = expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-3, atol=1e-5)
        except (RuntimeError, ValueError, IndexError):  # a module reads a size its attributes still say
            ok[kind] = False
    return [ok[g.kind] for g in groups]

"""Structures: which weights fall together when a model is pruned (docs/method.md §2, §11). One finder each, in
``STRUCTURES``.

A structure finds a model's *unit groups*. A group is the n interchangeable units of one layer: the filters of a
conv, the neurons of an FFN, the heads of an attention. A unit is a set of slices of several tensors that go
together (a neuron: its row of the up-projection and its column of the down-projection), so removing it is exact
and :func:`hf_sms.shrink` can cut it out. A finder is ``(model, tensors) -> [UnitGroup]``; ``"unstructured"``
finds none (every weight stands alone), ``"n:m"`` is its own pattern (:func:`hf_sms.pruning.allocations.n_of_m`),
and ``"a+b"`` joins the groups of both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..registry import ALLOCATIONS, STRUCTURES
from .allocations import _keep_top, _masked_scores, _n_keep, parse_n_of_m
from .prunable import Masks, PrunableTensor, filter_index, is_conv1d, n_filters, per_filter_sum, prunable_tensors

register_structure = STRUCTURES.register


@dataclass(frozen=True)
class Member:
    """Where a group's units lie in one tensor: along ``dim``, ``width`` entries per unit, starting at ``offset``
    (a fused qkv projection holds three members, one per part). ``masked``: a prunable weight the mask covers;
    else (a bias) only :func:`hf_sms.shrink` cuts it, since a unit whose weights are zero never reaches the output
    whatever its bias."""

    name: str
    dim: int
    offset: int = 0
    width: int = 1
    masked: bool = True

    def _units(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.movedim(self.dim, 0)[self.offset : self.offset + n * self.width].reshape(n, -1)

    def unit_sums(self, scores: torch.Tensor, n: int) -> torch.Tensor:
        return self._units(scores, n).sum(1)

    def unit_alive(self, mask: torch.Tensor, n: int) -> torch.Tensor:
        return self._units(mask, n).any(1)

    def _along(self, keep: torch.Tensor, size: int) -> torch.Tensor:
        along = torch.ones(size, dtype=torch.bool, device=keep.device)
        along[self.offset : self.offset + len(keep) * self.width] = keep.repeat_interleave(self.width)
        return along

    def expand(self, keep: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``keep`` (one bool per unit) as a mask that broadcasts over a tensor of ``shape``."""
        return self._along(keep, shape[self.dim]).view([-1 if d == self.dim else 1 for d in range(len(shape))])

    def index(self, keep: torch.Tensor, size: int) -> torch.Tensor:
        """Positions along ``dim`` a tensor of ``size`` there keeps when only the units ``keep`` stay."""
        return self._along(keep, size).nonzero().flatten()


@dataclass(frozen=True)
class FilterMember(Member):
    """The output filters of a conv weight of any layout (ConvTranspose, groups; Li et al. 2017)."""

    transposed: bool = False
    groups: int = 1

    def unit_sums(self, scores, n):
        return per_filter_sum(scores, self.transposed, self.groups)

    def unit_alive(self, mask, n):
        return per_filter_sum(mask.long(), self.transposed, self.groups) > 0

    def expand(self, keep, shape):
        return keep[filter_index(shape, self.transposed, self.groups).to(keep.device).expand(shape)]


@dataclass(frozen=True)
class UnitGroup:
    """``n_units`` interchangeable units, each the slices of ``members`` at its index.

    Attributes:
        kind: ``"filters"``, ``"neurons"`` or ``"heads"``.
        name: where they are (a module name, or what several layers share, e.g. T5's encoder self-attention).
        config: ``{config field: units per count}``: how the family's config counts the units that remain
            (T5's ``d_ff`` counts neurons; LLaMA's ``num_attention_heads`` counts query heads per kv group; timm's
            ``mlp_ratio`` counts them per unit of the block's width, ``1 / dim``).
        modules: ``{module name: {attribute: units per count}}`` that count them in the modules (T5's ``n_heads``).
        layers: how many layers share the units (T5's self-attention heads span a stack), for reports.
    """

    kind: str
    name: str
    n_units: int
    members: tuple[Member, ...]
    config: dict[str, float] = field(default_factory=dict)
    modules: dict[str, dict[str, int]] = field(default_factory=dict)
    layers: int = 1


# -- filters -------------------------------------------------------------------------------------------------------
@register_structure("filters", prunes="conv")
def filters(model: nn.Module, tensors: list[PrunableTensor]) -> list[UnitGroup]:
    """Every conv's output filters (Li et al. 2017); :func:`hf_sms.shrink` follows their channels with torch.fx."""
    return [
        UnitGroup(
            "filters",
            t.name.removesuffix(".weight"),
            n_filters(t.param.shape, t.transposed, t.groups),
            (FilterMember(t.name, 0, transposed=t.transposed, groups=t.groups),),
        )
        for t in tensors
        if t.kind == "conv"
    ]


def _filter_norms(p: int):
    def allocate(tensors, weights, masks, sparsity):
        return unit_masks(filters(None, tensors), {n: w.abs().pow(p) for n, w in weights.items()}, masks, sparsity)

    allocate.__doc__ = f"The former name of structure='filters', criterion='l{p}' (Li et al. 2017)."
    return allocate


# The names filter pruning had before structures: still allocations, resolved to what they mean.
ALLOCATIONS.add("filter_l2", _filter_norms(2), structure="filters", criterion="l2", prunes="conv")
ALLOCATIONS.add("filter_l1", _filter_norms(1), structure="filters", criterion="l1", prunes="conv")


# -- neurons ---------------------------------------------------------------------------------------------------------
# FFN blocks by class: (up-projections, down-projection, config field counting the hidden units). A neuron j is
# row j of each up-projection (Conv1D: column j) and column j of the down-projection (Conv1D: row j).
_FFNS: list[tuple[Callable[[nn.Module], bool], tuple[str, ...], str, str | None]] = [
    (lambda m: type(m).__name__ == "T5DenseActDense", ("wi",), "wo", "d_ff"),
    (lambda m: type(m).__name__ == "T5DenseGatedActDense", ("wi_0", "wi_1"), "wo", "d_ff"),
    (lambda m: type(m).__name__ == "GPT2MLP", ("c_fc",), "c_proj", "n_inner"),
    (  # LLaMA, Mistral, Qwen2, Gemma ...: down(act(gate(x)) * up(x))
        lambda m: (
            type(m).__name__.endswith("MLP") and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
        ),
        ("gate_proj", "up_proj"),
        "down_proj",
        "intermediate_size",
    ),
    (  # BERT, RoBERTa, ViT ...: a layer with ``intermediate.dense`` and ``output.dense``
        lambda m: (
            type(getattr(m, "intermediate", None)).__name__.endswith("Intermediate")
            and type(getattr(m, "output", None)).__name__.endswith("Output")
        ),
        ("intermediate.dense",),
        "output.dense",
        "intermediate_size",
    ),
    (  # timm's Mlp/ConvMlp (ViT, MaxViT): fc2(drop(norm(act(fc1(x))))), exact only without a norm over the units
        lambda m: type(m).__name__ in ("Mlp", "ConvMlp") and isinstance(getattr(m, "norm", nn.Identity()), nn.Identity),
        ("fc1",),
        "fc2",
        None,
    ),
]


def _layer_member(model: nn.Module, name: str, names: dict[int, str], output: bool, width: int = 1, offset: int = 0):
    """Members of the layer ``name``: its weight (and bias, for an output side) along its output or input units."""
    layer = model.get_submodule(name)
    if not isinstance(layer, (nn.Linear, nn.Conv2d)) and not is_conv1d(layer):
        return None
    if isinstance(layer, nn.Conv2d) and (layer.groups != 1 or math.prod(layer.kernel_size) != 1):
        return None  # only 1x1 convs are linear layers over channels
    dim = (1 if output else 0) if is_conv1d(layer) else (0 if output else 1)
    members = [Member(names[id(layer.weight)], dim, offset, width)]
    if output and getattr(layer, "bias", None) is not None:
        members.append(Member(names[id(layer.bias)], 0, offset, width, masked=False))
    return members


# timm models whose MLP width is a factory argument: hidden = int(dim * ratio), dim the block's width (fc1's input)
_TIMM_RATIOS = {"VisionTransformer": "mlp_ratio", "MaxxVit": "transformer_expand_ratio"}


def _timm_ratio(model: nn.Module, name: str, mlp: nn.Module) -> dict | None:
    """``{factory argument: 1 / dim}`` of a timm ``Mlp`` whose width the model's factory argument sets (``shrink``
    writes ``kept / dim``), ``{}`` elsewhere; ``None`` for an MLP whose width nothing can state (MaxViT's relative
    position MLP): its units are not pruned."""
    parent = model.get_submodule(name.rpartition(".")[0]) if name else None
    if type(parent).__name__ == "RelPosMlp":
        return None
    field = _TIMM_RATIOS.get(type(model).__name__)
    return {field: 1 / mlp.fc1.in_features} if field else {}


@register_structure("neurons", prunes="linear")
def neurons(model: nn.Module, tensors: list[PrunableTensor]) -> list[UnitGroup]:
    """The hidden units of every FFN block of a known kind (T5, gated T5, GPT-2, LLaMA-style, BERT/ViT-style, timm
    ``Mlp``); see ``_FFNS``."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for module_name, module in model.named_modules():
        for matches, ups, down, config_field in _FFNS:
            if not matches(module):
                continue
            prefix = f"{module_name}." if module_name else ""
            parts = [_layer_member(model, prefix + up, names, output=True) for up in ups]
            parts.append(_layer_member(model, prefix + down, names, output=False))
            if any(p is None for p in parts):
                continue
            members = tuple(m for p in parts for m in p)
            n = model.get_parameter(members[0].name).shape[members[0].dim]
            config = {config_field: 1} if config_field else _timm_ratio(model, module_name, module)
            if config is not None and all(model.get_parameter(m.name).shape[m.dim] == n for m in members):
                groups.append(UnitGroup("neurons", module_name, n, members, config))
            break
    return groups


# -- heads -----------------------------------------------------------------------------------------------------------
def _attention_members(prefix: str, projections: tuple[str, ...], out: str, names, model, width, kv=None):
    members = []
    for p in projections:
        members += _layer_member(model, prefix + p, names, output=True, width=width)
    for p, w in kv or ():
        members += _layer_member(model, prefix + p, names, output=True, width=w)
    members += _layer_member(model, prefix + out, names, output=False, width=width)
    return members


def _t5_heads(model, names) -> list[UnitGroup]:
    """T5: the first self-attention of a stack computes the relative position bias that every later layer of the
    stack adds, head by head. So a self-attention head is one unit across the whole stack (removed in every layer
    or in none), with its column of the bias; each cross-attention (no relative bias) is a group of its own."""
    groups = []
    for stack_name, stack in model.named_modules():
        if type(stack).__name__ != "T5Stack":
            continue
        self_members, self_modules, n = [], {}, None
        for i, block in enumerate(stack.block):
            for j, layer in enumerate(block.layer):
                attention = getattr(layer, "SelfAttention", None) or getattr(layer, "EncDecAttention", None)
                if attention is None:
                    continue
                prefix = f"{stack_name}.block.{i}.layer.{j}.{'SelfAttention' if j == 0 else 'EncDecAttention'}."
                d_kv, n = attention.key_value_proj_dim, attention.n_heads
                members = _attention_members(prefix, ("q", "k", "v"), "o", names, model, d_kv)
                if attention.has_relative_attention_bias:
                    members.append(Member(names[id(attention.relative_attention_bias.weight)], 1))
                modules = {prefix[:-1]: {"n_heads": 1, "inner_dim": d_kv}}
                if j == 0:
                    self_members += members
                    self_modules.update(modules)
                else:
                    groups.append(UnitGroup("heads", prefix[:-1], n, tuple(members), {"num_heads": 1}, modules))
        if self_members:
            name = f"{stack_name}: self-attention of every block"
            groups.append(
                UnitGroup("heads", name, n, tuple(self_members), {"num_heads": 1}, self_modules, len(self_modules))
            )
    return groups


def _kv_group_heads(model, names) -> list[UnitGroup]:
    """LLaMA-style attention (``q_proj``/``k_proj``/``v_proj``/``o_proj``, the config says ``head_dim``): a unit is
    one key/value head with the query heads that read it (grouped-query attention), so the ratio stays whole."""
    groups = []
    for module_name, module in model.named_modules():
        if not all(isinstance(getattr(module, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            continue
        config = getattr(module, "config", None) or getattr(model, "config", None)
        if config is None or not hasattr(config, "num_key_value_heads") or not hasattr(module, "head_dim"):
            continue
        hd, n_kv = module.head_dim, config.num_key_value_heads
        rep = config.num_attention_heads // n_kv
        prefix = f"{module_name}." if module_name else ""
        members = _attention_members(
            prefix, ("q_proj",), "o_proj", names, model, rep * hd, (("k_proj", hd), ("v_proj", hd))
        )
        fields = {"num_attention_heads": rep, "num_key_value_heads": 1}
        groups.append(UnitGroup("heads", module_name, n_kv, tuple(members), fields))
    return groups


# Attention modules whose family derives the head size from the hidden size (hidden / heads): a smaller model
# with fewer heads of the same size cannot be written in their config.
_FIXED_HEADS = {"GPT2Attention": "GPT-2", "BertSelfAttention": "BERT", "ViTSelfAttention": "ViT", "Attention": "timm"}


@register_structure("heads", prunes="linear")
def heads(model: nn.Module, tensors: list[PrunableTensor]) -> list[UnitGroup]:
    """Attention heads: T5 (``q``/``k``/``v``/``o`` and the relative position bias) and LLaMA-style attention (one
    unit per key/value head). A family whose config derives the head size from the hidden size (GPT-2, BERT, ViT,
    timm) cannot express fewer heads: ``ValueError``."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = _t5_heads(model, names) + _kv_group_heads(model, names)
    if not groups:
        fixed = {_FIXED_HEADS[type(m).__name__] for m in model.modules() if type(m).__name__ in _FIXED_HEADS}
        if fixed:
            raise ValueError(
                f"structure 'heads': {', '.join(sorted(fixed))} computes the head size as hidden size / heads, so "
                "a model with fewer heads of the same size cannot be written in its config; prune 'neurons' instead"
            )
    return groups


@register_structure("unstructured")
def unstructured(model: nn.Module, tensors: list[PrunableTensor]) -> list[UnitGroup]:
    """Every weight on its own (the paper's IMP): no groups."""
    return []


# -- names: "n:m" and "a+b" ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NOfM:
    """The ``"n:m"`` structure: ``n`` of every ``m`` consecutive input weights of a linear layer."""

    n: int
    m: int


def _parse(name: str):
    if not isinstance(name, str):
        return None
    nm = parse_n_of_m(name)
    if nm is not None:
        return NOfM(*nm)
    if "+" in name:
        parts = [p.strip() for p in name.split("+")]
        if any(p in ("", "unstructured") or parse_n_of_m(p) for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"structure={name!r} joins unit structures, each once, e.g. 'neurons+heads'")
        finders = [STRUCTURES.get(p) for p in parts]
        return lambda model, tensors: [g for f in finders for g in f(model, tensors)]
    return None


STRUCTURES.parse = _parse


def is_unit_structure(name: str) -> bool:
    """Whether ``name`` prunes whole units (filters, neurons, heads), as opposed to weights or an n:m pattern."""
    return name != "unstructured" and not isinstance(STRUCTURES.get(name), NOfM)


def unit_groups(model: nn.Module, structure: str, tensors: list[PrunableTensor] | None = None) -> list[UnitGroup]:
    """The unit groups ``structure`` finds in ``model`` (``[]`` for ``"unstructured"`` and ``"n:m"``)."""
    finder = STRUCTURES.get(structure)
    return [] if isinstance(finder, NOfM) else finder(model, prunable_tensors(model) if tensors is None else tensors)


def unit_masks(groups: list[UnitGroup], scores: dict[str, torch.Tensor], masks: Masks, sparsity: float) -> Masks:
    """Masks removing ``round(sparsity * n)`` units of every group (more if earlier masks removed more; removed
    units stay removed), those whose weights score lowest in total. Weights outside every group keep their masks.

    Raises ``ValueError`` where a group would keep no unit (a model with no layer of that width).
    """
    out = dict(masks)
    for g in groups:
        masked = [m for m in g.members if m.masked]
        alive = torch.stack([m.unit_alive(masks[m.name], g.n_units) for m in masked]).any(0)
        n_keep = _n_keep(g.n_units, sparsity, int(alive.sum()))
        if n_keep < 1:
            raise ValueError(
                f"sparsity {sparsity:g} removes every one of the {g.n_units} {g.kind} of {g.name}; a layer needs at "
                f"least one: use a sparsity below {1 - 0.5 / g.n_units:.4g}"
            )
        total = sum(m.unit_sums(scores[m.name].to(alive.device), g.n_units) for m in masked)
        keep = _keep_top(_masked_scores(total, alive), n_keep)
        for m in masked:
            out[m.name] = out[m.name] & m.expand(keep, out[m.name].shape).to(out[m.name].device)
    return out


@torch.no_grad()
def removed_units(model: nn.Module, group: UnitGroup) -> torch.Tensor:
    """Bool per unit of ``group``: True where every masked weight of the unit is exactly zero."""
    masked = [m for m in group.members if m.masked]
    params = [model.get_parameter(m.name).detach() != 0 for m in masked]
    return ~torch.stack([m.unit_alive(p, group.n_units) for m, p in zip(masked, params)]).any(0)


def unit_report(model: nn.Module, structure: str) -> dict:
    """``{kind: {"sparsity", "removed", "units"}}``: the fraction of each kind of unit that is entirely zero."""
    report: dict[str, dict] = {}
    for g in unit_groups(model, structure):
        entry = report.setdefault(g.kind, {"removed": 0, "units": 0})
        entry["removed"] += int(removed_units(model, g).sum()) * g.layers
        entry["units"] += g.n_units * g.layers
    for entry in report.values():
        entry["sparsity"] = entry["removed"] / max(entry["units"], 1)
    return report

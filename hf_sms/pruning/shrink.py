"""``shrink``: a pruned model's removed units cut out, giving a physically smaller model of the same class
(docs/method.md §11).

Neurons and heads (:mod:`hf_sms.pruning.structures`) leave their tensors along the units' dims, the modules and the
family's config are told the new counts (T5's ``d_ff`` and ``num_heads``, LLaMA's ``intermediate_size``,
``num_attention_heads`` and ``num_key_value_heads``), so ``save_pretrained`` writes an ordinary checkpoint that the
family loads without hf-sms. Conv filters go through :func:`hf_sms.pruning.structured.shrink_filters` (torch.fx).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import torch
from torch import nn

from ..batchnorm import forward_batch
from .fit_config import dense_arguments, fit_filters, rebuild_dense
from .prunable import accepts_labels, is_conv1d, unfused_attention
from .structured import module_zero_filters, shrink_filters
from .structures import UnitGroup, neurons, removed_units, unit_groups, unit_report
from .structures import heads as find_heads


def _groups(model: nn.Module, structure: str | None) -> list[UnitGroup]:
    if structure is not None:  # conv filters are followed through the graph instead (shrink_filters)
        return [g for g in unit_groups(model, structure) if g.kind != "filters"]
    try:
        attention = find_heads(model, [])
    except ValueError:  # a family that cannot say fewer heads: its heads stay
        attention = []
    return neurons(model, []) + attention


def _kept_units(model: nn.Module, groups: list[UnitGroup]) -> list[torch.Tensor]:
    """Per group, the units that stay. Groups whose count one config field states keep the same number: a group
    that removed fewer keeps its own, the others keep some removed (all-zero, so exact) units as well."""
    keep = [~removed_units(model, g) for g in groups]
    by_field: dict[tuple, list[int]] = {}
    for i, g in enumerate(groups):
        by_field.setdefault(tuple(sorted(g.config)) or ("", i), []).append(i)
    for members in by_field.values():
        # the config value the group that keeps most needs (units times units per count), never a width of 0
        per = [next(iter(groups[i].config.values()), 1) for i in members]
        need = max(max(int(keep[i].sum()), 1) * p for i, p in zip(members, per))
        for i, p in zip(members, per):
            missing = math.ceil(need / p - 1e-6) - int(keep[i].sum())
            if missing > 0:
                keep[i] = keep[i].clone()
                keep[i][(~keep[i]).nonzero().flatten()[:missing]] = True
    return keep


def _resize(layer: nn.Module) -> None:
    """A layer's size attributes from its (sliced) weight."""
    w = layer.weight
    if isinstance(layer, nn.Linear):
        layer.out_features, layer.in_features = w.shape
    elif is_conv1d(layer):
        layer.nf = w.shape[1]
    elif isinstance(layer, nn.Conv2d):
        layer.out_channels, layer.in_channels = w.shape[:2]
    elif isinstance(layer, nn.Embedding):
        layer.embedding_dim = w.shape[1]


def _set_config(model: nn.Module, field: str, n: int, per_unit: float) -> None:
    if hasattr(model, "_model_args"):  # timm: the factory argument save_for_hf writes, a ratio of the block width
        dim, ratio = round(1 / per_unit), n * per_unit
        while int(dim * ratio) < n:  # the factory's int() must give the width back
            ratio = math.nextafter(ratio, math.inf)
        model._model_args = {**model._model_args, field: ratio}
    else:
        setattr(model.config, field, round(n * per_unit))


def _cut(model: nn.Module, groups: list[UnitGroup], keep: list[torch.Tensor]) -> None:
    layers = set()
    for g, kept in zip(groups, keep):
        if bool(kept.all()):
            continue
        for m in g.members:
            owner_name, attribute = m.name.rpartition(".")[::2]
            owner = model.get_submodule(owner_name)
            tensor = getattr(owner, attribute)
            index = m.index(kept.to(tensor.device), tensor.shape[m.dim])
            setattr(
                owner, attribute, nn.Parameter(tensor.detach().index_select(m.dim, index).clone(), tensor.requires_grad)
            )
            layers.add(owner_name)
        n = int(kept.sum())
        for module_name, attributes in g.modules.items():
            module = model.get_submodule(module_name)
            for attribute, per_unit in attributes.items():
                setattr(module, attribute, n * per_unit)
        for field, per_unit in g.config.items():
            _set_config(model, field, n, per_unit)
    for name in layers:
        _resize(model.get_submodule(name))


def _output(out) -> torch.Tensor:
    if torch.is_tensor(out):
        return out
    if isinstance(out, Mapping) or hasattr(out, "logits"):
        logits = getattr(out, "logits", None)
        if logits is not None:
            return logits
        return next(v for v in (out.values() if isinstance(out, Mapping) else out) if torch.is_tensor(v))
    return _output(out[0])


@torch.no_grad()
def _eval_output(model: nn.Module, example_inputs) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        with unfused_attention():
            device = next(model.parameters()).device
            return _output(forward_batch(model, example_inputs, device, keep_labels=accepts_labels(model))).float()
    finally:
        model.train(was_training)


@torch.no_grad()
def shrink(
    model: nn.Module, example_inputs=None, rtol: float = 1e-4, structure: str | None = None, fit_config: bool = True
) -> nn.Module:
    """A physically smaller copy of ``model`` without its removed units: FFN neurons, attention heads and conv
    filters whose weights are all exactly zero (pruned with ``structure="neurons"``, ``"heads"``, ``"filters"``).

    The copy has ``model``'s class and module names, smaller layers and an updated config (T5: ``d_ff``,
    ``num_heads``; GPT-2: ``n_inner``; BERT/ViT and LLaMA: ``intermediate_size``, LLaMA also
    ``num_attention_heads``/``num_key_value_heads``), so its ``save_pretrained`` loads with plain
    ``AutoModel*.from_pretrained``. Layers that one config field sizes keep the same number of units: if some
    removed fewer, the others keep a few removed (all-zero) units too, which changes no output. Removing a unit is
    exact: its output never reaches the block. ``model`` is not changed.

    Args:
        model: a pruned model (transformers, timm, smp or plain torch).
        example_inputs: a batch (tensor, tuple, or dict by forward argument name). Needed to follow conv channels
            (:func:`hf_sms.pruning.structured.shrink_filters`); with it the copy's eval outputs are checked
            against ``model``'s.
        rtol: the largest difference of the outputs allowed, relative to their largest magnitude.
        structure: whose units to cut (a name in ``STRUCTURES``, e.g. one of your own); default: every built-in
            neuron and head. All-zero conv filters are always cut.
        fit_config: cut a timm or smp convnet's filters down to widths its constructor arguments state (timm
            ResNet's ``base_width``, smp PSPNet's ``psp_out_channels``, ...; :mod:`hf_sms.pruning.fit_config`),
            written into its config so that timm / smp load the copy by themselves. ``False``: cut every removable
            channel (faster where the arguments cannot state a width; only hf-sms or your code then rebuilds it).

    Returns:
        The smaller model, in ``model``'s training mode.

    Raises:
        ValueError: zero conv filters but no ``example_inputs``; or outputs that differ (a layer of a kind whose
            units are not independent: report it).
    """
    shrunk = copy.deepcopy(model)
    groups = _groups(shrunk, structure)
    _cut(shrunk, groups, _kept_units(shrunk, groups))
    config = getattr(shrunk, "config", None)
    if any("num_key_value_heads" in g.config for g in groups) and config is not None:
        config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // model.config.num_attention_heads
    convs = [m for m in shrunk.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    if any(bool(module_zero_filters(c).any()) for c in convs):
        if example_inputs is None:
            raise ValueError(
                "shrink: conv filters are removed; pass example_inputs (one batch) to follow their channels"
            )
        shrunk = fit_filters(shrunk, example_inputs)[0] if fit_config else shrink_filters(shrunk, example_inputs)
    if example_inputs is not None:
        expected, got = _eval_output(model, example_inputs), _eval_output(shrunk, example_inputs)
        scale = float(expected.abs().max().clamp_min(1e-12))
        if expected.shape != got.shape or float((expected - got).abs().max()) > rtol * scale:
            raise ValueError(
                f"shrink: the smaller {type(model).__name__} computes other outputs than the pruned one; a layer "
                "does not keep its units independent. Please report it with the model's class"
            )
    return shrunk


# The transformers config fields shrink sets, which give the dense shapes back (hf-sms speed on a smaller folder).
DENSE_FIELDS = ("d_ff", "num_heads", "n_inner", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def dense_shaped(smaller: nn.Module, dense_config: dict) -> nn.Module:
    """A randomly initialised model of ``smaller``'s class with the dense widths ``dense_config`` records (only
    :data:`DENSE_FIELDS`, positive integers; for timm and smp convnets the constructor arguments
    :func:`hf_sms.pruning.fit_config.dense_arguments` gives): the same shapes as the model it was shrunk from, for
    timing."""
    if (rebuilt := rebuild_dense(smaller, dense_config)) is not None:
        return rebuilt.to(next(smaller.parameters()).device).eval()
    config = copy.deepcopy(getattr(smaller, "config", None))
    bad = {
        k: v for k, v in dense_config.items() if k not in DENSE_FIELDS or not isinstance(v, int) or not 0 < v < 2**20
    }
    if config is None or bad or not dense_config:
        raise ValueError(f"cannot rebuild the dense shapes from {dense_config!r} (fields {DENSE_FIELDS})")
    for field, value in dense_config.items():
        setattr(config, field, value)
    if "num_key_value_heads" in dense_config:
        config.head_dim = smaller.config.head_dim
    dense = type(smaller)(config).to(next(smaller.parameters()).device)
    return dense.eval()


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, tied ones counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shrink_record(dense: nn.Module, pruned: nn.Module, shrunk: nn.Module, structure: str) -> dict:
    """What a structured soup's ``sparsity.json`` and card say of it: the units removed (measured on the pruned
    model), the parameters of the smaller model against the dense one, and the all-zero filters it keeps where its
    family's arguments cannot state a smaller width."""
    config = getattr(dense, "config", None)
    fields = {f for g in unit_groups(pruned, structure) for f in g.config if f in DENSE_FIELDS}
    dense_config = {f: getattr(config, f) for f in sorted(fields) if isinstance(getattr(config, f, None), int)}
    convs = [m for m in shrunk.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    return {
        "structure": structure,
        "units": unit_report(pruned, structure),
        "dense_config": {**dense_config, **dense_arguments(dense, shrunk)},
        "zero_filters_kept": sum(int(module_zero_filters(c).sum()) for c in convs),
        "parameters": parameter_count(shrunk),
        "dense_parameters": parameter_count(dense),
        "parameter_ratio": parameter_count(shrunk) / max(parameter_count(dense), 1),
    }

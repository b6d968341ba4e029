"""Structured (filter) pruning, Li et al. 2017 "Pruning Filters for Efficient ConvNets" (docs/method.md §2).

The allocations ``filter_l2``/``filter_l1`` (:mod:`hf_sms.pruning.allocations`) mask whole conv output filters. This
module measures them (:func:`filter_sparsity`) and exports a masked convnet as a physically smaller dense one
(:func:`shrink_filters`): a removed filter takes its feature map with it, so the BatchNorm channel that
normalises it and the consumers' input channels that read it go too, as in Li et al. 2017 §3.2.
"""

from __future__ import annotations

import copy
import math
import operator
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import fx, nn

from .prunable import n_filters, per_filter_sum, prunable_tensors

_BN = nn.modules.batchnorm._BatchNorm
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def zero_filters(weight: torch.Tensor, transposed: bool = False, groups: int = 1) -> torch.Tensor:
    """Bool per output filter of a conv ``weight``: True where every weight of the filter is exactly zero."""
    return per_filter_sum((weight.detach() != 0).long(), transposed, groups) == 0


def module_zero_filters(conv: nn.Module) -> torch.Tensor:
    """:func:`zero_filters` of a conv module's weight, whatever its layout (ConvTranspose, groups)."""
    return zero_filters(conv.weight, bool(getattr(conv, "transposed", False)), int(getattr(conv, "groups", 1)))


@torch.no_grad()
def filter_sparsity(model: nn.Module) -> dict:
    """Fraction of conv output filters that are entirely zero, overall and per conv weight (Li et al. 2017).

    Returns ``{"sparsity", "zero_filters", "filters", "per_tensor": {name: {"sparsity", "zero_filters",
    "filters"}}}``; a model without convolutions reports 0 of 0 filters.
    """
    per_tensor, zeros, total = {}, 0, 0
    for t in prunable_tensors(model):
        if t.kind != "conv":
            continue
        z = int(zero_filters(t.param, t.transposed, t.groups).sum())
        n = n_filters(t.param.shape, t.transposed, t.groups)
        per_tensor[t.name] = {"sparsity": z / n, "zero_filters": z, "filters": n}
        zeros, total = zeros + z, total + n
    return {"sparsity": zeros / max(total, 1), "zero_filters": zeros, "filters": total, "per_tensor": per_tensor}


# -- shrink_filters: channel spaces on a torch.fx graph ----------------------------------------------------
# A "channel space" is a set of tensors whose dim 1 indexes the same channels: a conv's output, then everything
# channel-wise ops (BatchNorm, activations, pooling, dropout, global means, flattening 1x1 maps) derive from it,
# and every tensor a residual add joins to it. A channel of a space can be removed only if every conv producing
# the space removed that filter; any op not known to act channel by channel "pins" the spaces it reads, which
# keeps them whole (always correct, just no smaller).
_CHANNELWISE = tuple(
    getattr(nn, name)
    for name in (
        "ReLU ReLU6 LeakyReLU GELU SiLU Hardswish Mish ELU Tanh Sigmoid Identity Dropout Dropout1d Dropout2d "
        "Dropout3d MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d "
        "AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d Upsample UpsamplingBilinear2d "
        "UpsamplingNearest2d"
    ).split()
)
_F = nn.functional
_CHANNELWISE_FUNCTIONS = {torch.relu, torch.sigmoid, torch.tanh, _F.relu, _F.gelu, _F.silu, _F.dropout, _F.max_pool2d}
_CHANNELWISE_FUNCTIONS |= {_F.avg_pool2d, _F.adaptive_avg_pool2d, _F.interpolate, operator.mul, operator.truediv}
_CHANNELWISE_FUNCTIONS |= {"relu", "relu_", "sigmoid", "tanh", "contiguous", "clone"}  # tensor methods
_ADDS = {operator.add, operator.iadd, torch.add, "add", "add_"}
_REDUCTIONS = {torch.mean, torch.amax, "mean", "amax"}
_RESHAPES = {torch.flatten, torch.squeeze, "flatten", "view", "reshape", "squeeze"}


class _Graph:
    """Union-find over channel spaces, plus the producers, BatchNorms and consumers of each."""

    def __init__(self):
        self.parent: list[int] = []
        self.pinned: set[int] = set()
        self.producers: list[tuple[str, int]] = []  # (conv, space of its output)
        self.followers: list[tuple[str, int]] = []  # (BatchNorm, space it normalises)
        self.consumers: list[tuple[str, int, fx.Node]] = []  # (conv or linear, space of its input, input node)

    def new(self, pinned: bool = False) -> int:
        self.parent.append(len(self.parent))
        if pinned:
            self.pinned.add(len(self.parent) - 1)
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = i = self.parent[self.parent[i]]
        return i

    def union(self, a: int, b: int) -> int:
        self.parent[self.find(a)] = self.find(b)
        return b


def _tensor_args(node: fx.Node, space: dict) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a in space]


def _reduced_dims(node: fx.Node, ndim: int) -> set[int]:
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dims = dims if isinstance(dims, (tuple, list)) else [dims]
    return {d % ndim for d in dims if isinstance(d, int)} if all(isinstance(d, int) for d in dims) else {1}


def _space_of(node: fx.Node, module: nn.Module | None, calls: int, env: dict, space: dict, g: _Graph) -> int | None:
    """The channel space of ``node``'s output, recording producers, BatchNorms and consumers on the way."""
    value, args = env[node], _tensor_args(node, space)
    first = args[0] if args else None
    single = len(args) == 1 and node.args and node.args[0] is first
    if not torch.is_tensor(value) or value.dim() < 2:
        holds_tensors = isinstance(value, (tuple, list)) and any(torch.is_tensor(v) for v in value)
        if torch.is_tensor(value) or holds_tensors:  # e.g. a sum over channels or a split; x.shape pins nothing
            g.pinned.update(space[a] for a in args)
        return None
    if module is not None and calls == 1 and single:
        if isinstance(module, _CONV) and module.groups == 1:
            g.consumers.append((node.target, space[first], first))
            g.producers.append((node.target, out := g.new()))
            return out
        if isinstance(module, nn.Linear) and env[first].dim() == 2:
            g.consumers.append((node.target, space[first], first))
            return g.new(pinned=True)
        if isinstance(module, _BN):
            g.followers.append((node.target, space[first]))
            return space[first]
    target = node.target if node.op in ("call_function", "call_method") else None
    if module is not None and single and (isinstance(module, _CHANNELWISE) or isinstance(module, nn.Flatten)):
        target = "flatten" if isinstance(module, nn.Flatten) else "relu"
    if target in _ADDS and len(args) == 2 and env[args[0]].shape[1] == env[args[1]].shape[1] == value.shape[1]:
        return g.union(space[args[0]], space[args[1]])
    if single and first is not None:
        inp = env[first]
        if target in _CHANNELWISE_FUNCTIONS and value.shape[:2] == inp.shape[:2]:
            return space[first]
        if target in _REDUCTIONS and 1 not in _reduced_dims(node, inp.dim()) and value.shape[:2] == inp.shape[:2]:
            return space[first]
        flat_1x1 = inp.dim() > 2 and math.prod(inp.shape[2:]) == 1 and value.shape == inp.shape[:2]
        if target in _RESHAPES and flat_1x1:
            return space[first]
    for a in args:  # anything else may mix channels: keep the spaces it reads whole
        g.pinned.add(space[a])
    return g.new(pinned=True)


def traced(model: nn.Module) -> fx.GraphModule:
    """``model``'s torch.fx graph, which :func:`shrink_filters` follows channels through; ``NotImplementedError``
    saying so where fx cannot trace it."""
    # smp checks the input's height with Python ifs fx cannot follow; the analysis runs one real batch instead
    skip_check = callable(getattr(type(model), "check_input_shape", None)) and "check_input_shape" not in vars(model)
    if skip_check:
        model.check_input_shape = lambda x: None
    try:
        return fx.symbolic_trace(model)
    except Exception as err:
        raise NotImplementedError(
            f"shrink_filters needs a model torch.fx can trace (plain convnets, hf_sms.demo.DigitsResNet, timm "
            f"ResNets, smp models); tracing {type(model).__name__} failed: {str(err)[:300]}"
        ) from err
    finally:
        if skip_check:
            del model.check_input_shape


@torch.no_grad()
def _analyse(model: nn.Module, example_inputs) -> tuple[fx.GraphModule, dict, _Graph]:
    gm = traced(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if isinstance(example_inputs, Mapping):
        args = [example_inputs[n.target] for n in placeholders]
    else:
        args = list(example_inputs) if isinstance(example_inputs, (tuple, list)) else [example_inputs]
    device = next(model.parameters()).device
    args = [a.to(device) if torch.is_tensor(a) else a for a in args]
    interpreter = fx.Interpreter(gm, garbage_collect_values=False)
    was_training = model.training
    model.eval()  # shrinking is exact in eval mode: BatchNorm uses its running statistics
    try:
        interpreter.run(*args)
    finally:
        model.train(was_training)
    env, g, space = interpreter.env, _Graph(), {}
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            if torch.is_tensor(env[node]) and env[node].dim() >= 2:
                space[node] = g.new(pinned=True)  # the input's channels (e.g. RGB) are never removed
        elif node.op == "output":
            g.pinned.update(space[a] for a in _tensor_args(node, space))
        else:
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            out = _space_of(node, module, calls.get(node.target, 0), env, space, g)
            if out is not None:
                space[node] = out
    return gm, env, g


def _slice(module: nn.Module, names: tuple[str, ...], dim: int, index: torch.Tensor) -> None:
    for name in names:
        tensor = getattr(module, name, None)
        if tensor is None:
            continue
        sliced = tensor.detach().index_select(dim, index.to(tensor.device)).clone()
        if isinstance(tensor, nn.Parameter):
            sliced = nn.Parameter(sliced, tensor.requires_grad)
        setattr(module, name, sliced)


@torch.no_grad()
def _removable(model: nn.Module, example_inputs, exact: bool) -> tuple[fx.GraphModule, _Graph, dict]:
    """The graph and, per channel space (its root), a bool per channel: True where every producer removed it and
    nothing keeps it (a pinned space, a nonzero constant read under ``exact``)."""
    gm, env, g = _analyse(model, example_inputs)
    removed: dict[int, torch.Tensor] = {}
    for name, sid in g.producers:
        zero, root = module_zero_filters(gm.get_submodule(name)), g.find(sid)
        removed[root] = removed[root] & zero if root in removed else zero
    for root in {g.find(s) for s in g.pinned}:
        removed.pop(root, None)
    for _, sid, node in g.consumers if exact else ():
        root = g.find(sid)
        if root in removed:  # the constant a removed channel carries must be exactly zero where it is read
            removed[root] = removed[root] & (env[node].transpose(0, 1).flatten(1) == 0).all(1).to(removed[root].device)
    for gone in removed.values():
        if gone.all():
            gone[0] = False  # keep one channel rather than build a zero-width layer
    return gm, g, removed


def kept_widths(model: nn.Module, example_inputs, exact: bool = True) -> dict[str, int]:
    """``{conv name: output channels}`` that :func:`shrink_filters` leaves each conv of ``model``: the fewest."""
    return _kept(*_removable(model, example_inputs, exact))


def _kept(gm: fx.GraphModule, g: _Graph, removed: dict) -> dict[str, int]:
    out = {}
    for name, sid in g.producers:
        gone = removed.get(g.find(sid))
        out[name] = gm.get_submodule(name).out_channels - (int(gone.sum()) if gone is not None else 0)
    return out


@torch.no_grad()
def shrink_filters(
    model: nn.Module,
    example_inputs,
    exact: bool = True,
    widths: Mapping[str, int] | Callable[[dict[str, int]], Mapping[str, int]] | None = None,
) -> nn.Module:
    """A physically smaller dense copy of ``model`` without its removed (all-zero) conv filters (Li et al. 2017).

    Each removed channel leaves the producing conv (weight rows and bias), its BatchNorm (affine parameters and
    running statistics) and the input channels of every conv or linear layer reading it. ``model`` is not changed.

    Supported: models torch.fx traces whose channels flow through ``Conv1d/2d/3d`` (groups=1), BatchNorm,
    element-wise activations, dropout, pooling, resizing, means over spatial dims, flattening of 1x1 maps, residual
    adds and ``Linear`` heads: plain ``nn.Sequential`` convnets, :class:`hf_sms.demo.DigitsResNet`, timm ResNets,
    smp's encoders and decoders (PSPNet, FPN, DeepLabV3, Unet). A residual
    channel goes only if every branch of the add removed it. Channels that reach any other op (concatenation,
    grouped/depthwise or transposed convs, attention, the model output) are kept whole; models fx cannot trace raise
    ``NotImplementedError``.

    Args:
        model: a masked model, e.g. pruned with ``allocation="filter_l2"``.
        example_inputs: a batch (tensor, tuple of positional inputs, or dict by forward argument name). One eval
            forward gives shapes and checks what removed channels carry.
        exact: a removed filter still emits a constant (its conv bias through BatchNorm and activation). With
            ``exact=True`` a channel is removed only where that constant is 0 at every consumer, so the shrunk
            model's eval outputs equal ``model``'s. With ``exact=False`` every removable channel goes with its
            constant: Li et al.'s convention, which :func:`hf_sms.evaluation.theoretical_speedup` counts (that
            count also skips a conv's reads of a channel removed before a residual add that a dense export keeps).
        widths: ``{conv name: output channels}`` to leave (at least :func:`kept_widths`'s, at most the conv's): a
            channel space keeps removed (all-zero) channels too, lowest first, up to its producers' width, so
            that the copy has the widths its family's config can state (:mod:`hf_sms.pruning.fit_config`). Or a
            function of the :func:`kept_widths` dict giving them, which then reads the model only once.

    Returns:
        The smaller model, same class and module names, in ``model``'s training mode.

    Raises:
        ValueError: ``widths`` below what :func:`kept_widths` leaves, above the conv's, or unequal in one space.
    """
    gm, g, removed = _removable(model, example_inputs, exact)
    if callable(widths):
        widths = widths(_kept(gm, g, removed))
    wanted: dict[int, int] = {}
    for name, sid in g.producers if widths else ():
        root, size = g.find(sid), gm.get_submodule(name).out_channels
        if name not in widths:
            continue
        gone = removed.get(root, torch.zeros(size, dtype=torch.bool))
        if not size - int(gone.sum()) <= widths[name] <= size or wanted.get(root, widths[name]) != widths[name]:
            raise ValueError(
                f"shrink_filters: width {widths[name]} for {name} is not between the {size - int(gone.sum())} "
                f"channels it keeps and its {size}, or differs from a conv joined to it (residual add)"
            )
        wanted[root] = widths[name]
    keep = {}
    for root, gone in removed.items():
        if (extra := wanted.get(root, 0) - int((~gone).sum())) > 0:  # keep removed channels too, lowest first
            gone = gone.clone()
            gone[gone.nonzero().flatten()[:extra]] = False
        if gone.any():
            keep[root] = (~gone).nonzero().flatten()
    shrunk = copy.deepcopy(model)
    for name, sid in g.producers:
        if (index := keep.get(g.find(sid))) is not None:
            conv = shrunk.get_submodule(name)
            _slice(conv, ("weight", "bias"), 0, index)
            conv.out_channels = len(index)
    for name, sid in g.followers:
        if (index := keep.get(g.find(sid))) is not None:
            bn = shrunk.get_submodule(name)
            _slice(bn, ("weight", "bias", "running_mean", "running_var"), 0, index)
            bn.num_features = len(index)
    for name, sid, _ in g.consumers:
        if (index := keep.get(g.find(sid))) is not None:
            layer = shrunk.get_submodule(name)
            _slice(layer, ("weight",), 1, index)
            setattr(layer, "in_channels" if isinstance(layer, _CONV) else "in_features", len(index))
    left = sum(int(module_zero_filters(shrunk.get_submodule(name)).sum()) for name, _ in g.producers)
    if left and not widths:  # with widths, the caller asked for them
        warnings.warn(
            f"shrink_filters kept {left} all-zero filters: their channels are read by an op kept whole, join a "
            "residual add in which another branch keeps them, or carry a nonzero constant (exact=True)",
            stacklevel=3,  # past torch.no_grad's wrapper
        )
    return shrunk

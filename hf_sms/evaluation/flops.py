"""The theoretical speedup: FLOPs of the dense model over FLOPs with every zero weight (and removed filter) skipped.

Counted from the matmuls and convolutions a forward pass really runs (a dispatch mode over aten), so tied
weights, attention and any layer type are covered. This is what sparse kernels could save; what they do save
on a machine is measured by :func:`hf_sms.runtime.measure_speedup`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..batchnorm import forward_batch
from ..pruning.prunable import _CONV, accepts_labels, prunable_tensors, unfused_attention
from ..pruning.structured import filter_sparsity, module_zero_filters

# aten matmuls and convolutions -> argument positions of their two operands (addmm/baddbmm add a bias first).
_aten = torch.ops.aten
_OPERANDS = {
    _aten.mm: (0, 1),
    _aten.bmm: (0, 1),
    _aten.addmm: (1, 2),
    _aten.baddbmm: (1, 2),
    _aten.convolution: (0, 1),
    _aten._convolution: (0, 1),
}


class _Op(NamedTuple):
    """One matmul or convolution with a weight operand: its FLOPs and the weight's size and nonzeros."""

    flops: float
    numel: int
    nnz: float
    nnz_per_input_channel: torch.Tensor | None = None  # convolutions, when input channels are tested
    input_channels: torch.Tensor | None = None  # channel_test(input): bool per input channel


class _WeightFlops(TorchDispatchMode):
    """Records the FLOPs of every matmul or convolution with a prunable weight operand, with that weight's zeros.

    FLOPs come from torch's own formulas (``torch.utils.flop_counter.flop_registry``). An operand is a
    weight if it shares storage with one, so views such as ``weight.t()`` or MHA's q/k/v slices of
    ``in_proj_weight`` count, however the layer calls the op (Linear, GPT-2's Conv1D, MHA, ConvTranspose).
    With ``channel_test``, each convolution also records its weight's nonzeros per input channel and
    ``channel_test(input)`` (one bool per input channel), for the structural count of removed filters.
    """

    def __init__(self, storages: set[int], channel_test: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.storages, self.channel_test = storages, channel_test
        self.ops: list[_Op] = []

    def _weight_operand(self, func, args) -> int | None:
        for i in _OPERANDS.get(getattr(func, "_overloadpacket", None), ()):
            if torch.is_tensor(args[i]) and args[i].untyped_storage().data_ptr() in self.storages:
                return i
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = self._weight_operand(func, args)
        if i is not None:
            weight = args[i]  # the operand itself, so a slice of a weight (MHA's q/k/v) counts its own zeros
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
            per_channel = flags = None
            if self.channel_test is not None and func._overloadpacket in _CONVOLUTIONS and i == 1:
                per_channel = _nnz_per_input_channel(weight, transposed=bool(args[6]), groups=int(args[8]))
                flags = self.channel_test(args[0])
            self.ops.append(_Op(flops, weight.numel(), float(torch.count_nonzero(weight)), per_channel, flags))
        return out


_CONVOLUTIONS = (_aten.convolution, _aten._convolution)
_CHANNEL_MIXING_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm)


def _nnz_per_input_channel(weight: torch.Tensor, transposed: bool, groups: int) -> torch.Tensor:
    """Nonzero weights of a convolution per input channel: ``(in, out / g, *k)`` if transposed, else ``(out, in / g,
    *k)``, where output channel ``o`` reads input channels ``o // (out / g) * (in / g) + j``."""
    nz = (weight != 0).flatten(2).sum(2)
    if transposed:
        return nz.sum(1)
    out, per_group = nz.shape
    return nz.view(groups, out // groups, per_group).sum(1).reshape(-1)


def _channels(x: torch.Tensor) -> torch.Tensor:
    return x.detach().transpose(0, 1).flatten(1)  # (channels, batch x positions)


def _constant_channels(x: torch.Tensor) -> torch.Tensor:
    flat = _channels(x)
    return flat.amax(1) == flat.amin(1)


def _zero_channels(x: torch.Tensor) -> torch.Tensor:
    return (_channels(x) == 0).all(1)


def _count(model: nn.Module, batch, channel_test=None) -> _WeightFlops:
    """One eval forward of ``batch`` under the FLOP recorder; the training mode is restored."""
    counter = _WeightFlops({t.param.untyped_storage().data_ptr() for t in prunable_tensors(model)}, channel_test)
    was_training = model.training
    model.eval()
    try:
        with unfused_attention(), counter:
            device = next(model.parameters()).device
            forward_batch(model, batch, device, keep_labels=accepts_labels(model))
    finally:
        model.train(was_training)
    return counter


def _positive(batch):
    """``batch`` with every float tensor made strictly positive (|x| + 1); ids, masks and labels unchanged."""
    if isinstance(batch, Mapping):
        return {k: _positive(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [_positive(v) for v in batch]
    return batch.abs() + 1 if torch.is_tensor(batch) and batch.is_floating_point() else batch


@torch.no_grad()
def _removed_filter_probe(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in which an activation channel is exactly zero iff removed filters make it so.

    Parameters become |p| and the batch |x| + 1, so activations are sums of nonnegative terms and a channel is
    zero only structurally, never by chance (a ReLU that happens to be dead on the batch stays nonzero here).
    A removed filter loses its conv bias and every BatchNorm passes its input through (zero in, zero out): the
    filter's feature map is gone with its BatchNorm channel, as when Li et al. 2017 remove it physically. Norms
    that mix channels or subtract means (GroupNorm, LayerNorm, RMSNorm, InstanceNorm) output ones: every channel
    after them lives.
    """
    probe = copy.deepcopy(model).eval()
    for p in probe.parameters():
        p.abs_()
    for m in probe.modules():
        if isinstance(m, _CONV) and m.bias is not None:
            m.bias.masked_fill_(module_zero_filters(m).to(m.bias.device), 0.0)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_hook(lambda module, args, out: args[0])
        elif isinstance(m, _CHANNEL_MIXING_NORMS):
            m.register_forward_hook(lambda module, args, out: torch.ones_like(out))
    return probe


def _without_removed_inputs(op: _Op, probe_op: _Op) -> _Op:
    """``op`` with its weight's nnz counted over input channels still alive (zero in the probe, constant here)."""
    zero = probe_op.input_channels
    if op.nnz_per_input_channel is None or zero is None or zero.shape != op.input_channels.shape:
        return op  # not a convolution, or the probe ran another op here: the weight's own zeros only
    constant, zero = op.input_channels, zero.to(op.input_channels.device)
    return _Op(op.flops, op.numel, float(op.nnz_per_input_channel[~(constant & zero)].sum()))


@torch.no_grad()
def theoretical_speedup(model: nn.Module, batch) -> float:
    """Dense FLOPs / FLOPs with zeros skipped, over conv and linear layers, on one batch (docs/method.md §8).

    Every matmul and convolution with a prunable weight as an operand counts, its sparse cost being
    ``flops * nnz / numel`` of that weight (ShrinkBench's convention, Blalock et al. 2020). Products of
    two activations (attention scores) are left out of both totals, as the paper counts conv and linear
    layers only.

    Structured masks (some conv filter entirely zero, e.g. ``allocation="filter_l2"``) are counted as Li et al.
    2017 count them, as if the removed filters were physically removed: a removed filter's feature map and its
    BatchNorm channel go, so every convolution reading that channel also skips the weights for it (its nnz counts
    only weights on input channels still alive). A channel counts as removed where it is zero in a probe copy in
    which only removed filters make zeros (see ``_removed_filter_probe``; a residual add keeps a channel alive if
    any branch feeds it) and constant over the batch and positions in ``model`` itself, so work that still
    depends on the input is never skipped. A conv that reads a tensor before a residual add skips the channels
    removed in it even if the add's other branch keeps them (a dense export,
    :func:`hf_sms.pruning.structured.shrink_filters`, cannot). Linear layers reading removed channels (a head after
    global pooling) are counted with their own zeros only. Without removed filters the count is the unstructured one
    above, on one forward; with them it takes two
    forwards and a copy of the model.
    """
    structured = filter_sparsity(model)["zero_filters"] > 0
    ops = _count(model, batch, _constant_channels if structured else None).ops
    if structured:
        probe_ops = _count(_removed_filter_probe(model), _positive(batch), _zero_channels).ops
        if len(probe_ops) == len(ops):
            ops = [_without_removed_inputs(op, probe_op) for op, probe_op in zip(ops, probe_ops, strict=True)]
        else:  # the probe took another path through the model: count each weight's own zeros only
            msg = "theoretical_speedup: the probe for removed filters ran other ops; counting each weight's zeros only"
            warnings.warn(msg, stacklevel=3)  # past torch.no_grad's wrapper
    dense = sum(op.flops for op in ops)
    sparse = sum(op.flops * op.nnz / op.numel for op in ops)
    return dense / sparse if sparse else float("inf")

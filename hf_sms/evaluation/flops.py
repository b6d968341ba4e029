"""The theoretical speedup: FLOPs of the dense model over FLOPs with every zero weight skipped.

Counted from the matmuls and convolutions a forward pass really runs (a dispatch mode over aten), so tied
weights, attention and any layer type are covered. This is what sparse kernels could save; what they do save
on a machine is measured by :func:`hf_sms.runtime.measure_speedup`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..batchnorm import forward_batch
from ..pruning.prunable import accepts_labels, prunable_tensors, unfused_attention

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


class _WeightFlops(TorchDispatchMode):
    """Records the FLOPs of every matmul or convolution with a prunable weight operand, with that weight's zeros.

    FLOPs come from torch's own formulas (``torch.utils.flop_counter.flop_registry``). An operand is a
    weight if it shares storage with one, so views such as ``weight.t()`` or MHA's q/k/v slices of
    ``in_proj_weight`` count, however the layer calls the op (Linear, GPT-2's Conv1D, MHA, ConvTranspose).
    """

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages = storages
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
            self.ops.append(_Op(flops, weight.numel(), float(torch.count_nonzero(weight))))
        return out


def _count(model: nn.Module, batch) -> _WeightFlops:
    """One eval forward of ``batch`` under the FLOP recorder; the training mode is restored."""
    counter = _WeightFlops({t.param.untyped_storage().data_ptr() for t in prunable_tensors(model)})
    was_training = model.training
    model.eval()
    try:
        with unfused_attention(), counter:
            device = next(model.parameters()).device
            forward_batch(model, batch, device, keep_labels=accepts_labels(model))
    finally:
        model.train(was_training)
    return counter


@torch.no_grad()
def theoretical_speedup(model: nn.Module, batch) -> float:
    """Dense FLOPs / FLOPs with zeros skipped, over conv and linear layers, on one batch (docs/method.md §8).

    Every matmul and convolution with a prunable weight as an operand counts, its sparse cost being
    ``flops * nnz / numel`` of that weight (ShrinkBench's convention, Blalock et al. 2020). Products of
    two activations (attention scores) are left out of both totals, as the paper counts conv and linear
    layers only.

    Whole units (filters, neurons, heads) count the same way: a unit's mask zeroes the slices of every layer that
    reads it too (:mod:`hf_sms.pruning.units`), so its weights' zeros are exactly what the smaller model drops (Li
    et al. 2017's count: a removed filter's FLOPs and the next layers' kernel slices that read it). Units a smaller
    model keeps as zeros (widths its config cannot state) count as removed here.
    """
    ops = _count(model, batch).ops
    dense = sum(op.flops for op in ops)
    sparse = sum(op.flops * op.nnz / op.numel for op in ops)
    return dense / sparse if sparse else float("inf")

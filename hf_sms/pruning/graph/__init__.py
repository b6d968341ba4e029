"""Units from the model's own graph (docs/method.md §11): which slices of which tensors index the same channels.

One forward on an example batch runs under a dispatch mode that sees every aten op (after autograd, so any model
that runs eagerly is covered: transformers, timm, smp, torch, with their attention kernels, fused projections and
functional calls). Each dimension of each tensor gets a *space*: the positions it indexes. Ops relate spaces: an
elementwise op or a residual add joins its inputs' channel spaces, a matmul or a convolution joins its input's
channels with the weight's input dimension and makes its output dimension the weight's output rows, a reshape
splits a space into factors (heads x head size) or joins spaces into one, a concatenation lays spaces end to end,
and an op that mixes positions of a space (a norm over channels, a softmax, an op hf-sms does not know, the model's
output) *pins* it: its positions stay.

A space that is not pinned and that some weight produces is a group of interchangeable units: zeroing one unit in
every weight that reads it (the next layers' input slices) removes it exactly, whatever else the producers leave
in the channel (bias, BatchNorm shift, activation of 0). Its kind:

- ``"heads"``: the outer factor of a projection's output that attention splits into heads (a unit: one head, or a
  key/value head with the query heads that read it);
- ``"filters"``: a channel a convolution produces (Li et al. 2017), followed through BatchNorm, activations,
  depthwise convs, squeeze-excite gates, pooling, resizing, residual adds and concatenations;
- ``"neurons"``: a hidden unit that linear (or 1x1 conv) layers produce and read, with elementwise ops between
  (an FFN, gated or not).
"""

from .ops import OPS
from .trace import Found, Trace, trace_units

__all__ = ["OPS", "Found", "Trace", "trace_units"]

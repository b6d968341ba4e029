"""The one averaging kernel. Every soup is formed here: in memory, across processes, or streamed from disk.

Floating-point tensors are summed in float64 with their weights and cast back to their dtype at the end;
integer tensors (``num_batches_tracked``) are taken from the first input, never averaged. A weighted mean of
tensors that are all exactly zero at a position is exactly zero there, so inputs sharing a mask give a
soup with that mask, bit for bit (docs/method.md §4).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class Accumulator:
    """A running weighted sum of tensors shaped like ``like``.

    ``add`` the inputs (in any number of calls, on any process), then ``result()``. Across processes,
    all-reduce ``total`` before ``result`` (see :meth:`hf_sms.loop.distributed.ReplicaWorld.average`).
    """

    def __init__(self, like: torch.Tensor, device: torch.device | str | None = None):
        self.dtype, self.floating = like.dtype, like.is_floating_point()
        self.total = torch.zeros(like.shape, dtype=torch.float64 if self.floating else like.dtype, device=device)
        self.first: torch.Tensor | None = None

    @torch.no_grad()
    def add(self, tensor: torch.Tensor, weight: float = 1.0) -> Accumulator:
        if tensor.shape != self.total.shape:
            raise ValueError(f"cannot average tensors of shapes {tuple(tensor.shape)} and {tuple(self.total.shape)}")
        if self.floating:
            self.total.add_(tensor.to(self.total.device, torch.float64), alpha=weight)
        elif self.first is None:
            self.first = tensor.to(self.total.device)
            self.total.copy_(self.first)
        return self

    def result(self, scale: float = 1.0) -> torch.Tensor:
        """The sum times ``scale`` (e.g. ``1/n`` when the inputs were added with weight 1) in the input dtype."""
        if not self.floating:
            return self.total.clone()
        return (self.total * scale if scale != 1.0 else self.total).to(self.dtype)


def average_tensors(tensors: Sequence[torch.Tensor], weights: Iterable[float] | None = None) -> torch.Tensor:
    """Weighted mean of same-shaped tensors (uniform if ``weights`` is None); integers: the first input."""
    if not tensors:
        raise ValueError("nothing to average: pass at least one tensor")
    weights = list(weights) if weights is not None else [1.0 / len(tensors)] * len(tensors)
    acc = Accumulator(tensors[0], tensors[0].device)
    for tensor, weight in zip(tensors, weights, strict=True):
        acc.add(tensor, weight)
    return acc.result()


BUCKET = 1 << 20  # elements per all-reduce of a soup or distance: float64 copies of 8 MiB, few collectives


def flat(state_dict: dict[str, torch.Tensor], keys) -> torch.Tensor:
    tensors = [state_dict[k].reshape(-1) for k in keys]
    return torch.cat(tensors) if tensors else torch.zeros(0)


def pieces(template: dict[str, torch.Tensor], keys) -> list[tuple[tuple[str, int, int], ...]]:
    """``keys``' elements in consecutive pieces of at most ``BUCKET``: ``((key, start, stop), ...)`` each, a larger
    tensor split over several (a LLaMA's embedding is a third of the model: its float64 copy alone would be 0.8x)."""
    out, current, size = [], [], 0
    for k in keys:
        n, lo = template[k].numel(), 0
        while lo < n:
            take = min(n - lo, BUCKET - size)
            current.append((k, lo, lo + take))
            size, lo = size + take, lo + take
            if size == BUCKET:
                out.append(tuple(current))
                current, size = [], 0
    return out + ([tuple(current)] if current else [])

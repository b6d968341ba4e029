"""What a soup method is: which candidates with which weights, and how their tensors combine.

A soup method is a :class:`SoupMethod` registered in :data:`hf_sms.registry.SOUPS`, one file each
(:mod:`hf_sms.soup.uniform`, :mod:`hf_sms.soup.greedy`, :mod:`hf_sms.soup.reprune`), as mergekit does it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# select(validation scores of the m candidates, trial(weights) -> validation score of that soup, config)
#   -> one weight per candidate (0 leaves a candidate out)
Select = Callable[[Sequence[float], Callable[[list[float]], float], object], list[float]]
# combine(the candidates' tensors of one name, their weights) -> the soup's tensor
Combine = Callable[[list[torch.Tensor], list[float]], torch.Tensor]


@dataclass(frozen=True)
class SoupMethod:
    """A soup method.

    Attributes:
        select: the candidates' weights, from their validation scores and trial soups.
        combine: how one tensor of the soup is made from the candidates' (floating-point tensors only; integer
            buffers come from the first kept candidate). ``None``: the weighted mean (:mod:`hf_sms.soup.averaging`),
            which keeps a shared mask exactly and, across processes, needs one all-reduce. Any other per-tensor
            function (TIES-, DARE-style) gathers the candidates to every process.
        needs_validation: ``select`` evaluates trial soups (so it needs validation data; ``hf-sms merge`` cannot
            run it).
        same_mask: the candidates must share one mask (checked); ``False``: their masks may differ.
        reprune: with differing masks, magnitude-prune the soup to the phase's sparsity (IMP-RePrune); ``False``:
            leave it as it is (DPF's dense copies, which the next pruning step masks).
    """

    select: Select
    combine: Combine | None = None
    needs_validation: bool = False
    same_mask: bool = True
    reprune: bool = True


def indicator_weights(indices: Sequence[int], n: int) -> list[float]:
    """Uniform weights over ``indices``, 0 for the other of ``n`` candidates."""
    return [1.0 / len(indices) if i in indices else 0.0 for i in range(n)]

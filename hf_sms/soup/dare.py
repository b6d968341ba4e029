"""DARE (Yu et al., ICML 2024), sparsity-adjusted: each candidate's update from the phase's start drops entries at
random, then the survivors are rescaled and the updates averaged (mergekit's ``dare_linear``).

Plain DARE drops among all entries and rescales by 1 / density; on a pruned model that also counts the mask's
zeros, and iterated it empties tensors (arcee-ai/mergekit#258). Here the drop is among the mask's kept entries only
and the survivors are rescaled by kept / survived, their exact count. Each candidate's draw is its own stream,
keyed by the soup's seed, the tensor's name and the candidate (the same on every process). Default from the
paper: drop rate 0.9 (``density=0.1``).
"""

from __future__ import annotations

import torch

from ..registry import SOUPS
from ..seeding import derive_seed
from .method import Option, SoupMethod, Tensors
from .ties import kept_entries
from .uniform import uniform_weights


def drop(update: torch.Tensor, kept: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """``update`` with each kept entry kept with probability ``density``, survivors times kept / survived."""
    n = int(kept.sum())
    keep = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) < density
    survived = int(keep.sum())
    out = torch.zeros_like(update)
    if survived:
        out[kept] = update[kept] * keep.to(update.device) * (n / survived)
    return out


@torch.no_grad()
def dare(tensors: list[torch.Tensor], weights: list[float], t: Tensors) -> torch.Tensor:
    base = t.base.to(torch.float64)
    kept = kept_entries(t.base, tensors)
    out = base.clone()
    for i, (x, w) in enumerate(zip(tensors, weights)):
        out += w * drop(x.to(torch.float64) - base, kept, t.options["density"], derive_seed(t.seed, t.name, i))
    return out.to(tensors[0].dtype)


DARE_OPTIONS = (Option("density", 0.1, 0.0, 1.0, open_low=True, help="chance that a kept entry's update stays"),)
SOUPS.add("dare", SoupMethod(uniform_weights, combine=dare, needs_base=True, options=DARE_OPTIONS))

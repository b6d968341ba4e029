"""TIES-Merging (Yadav et al., NeurIPS 2023) of the candidates' updates from the phase's start: trim each update
to its largest ``density`` fraction by magnitude, elect a sign per entry, average the updates that agree with it.

The fraction counts the mask's kept entries only (a pruned entry's update is zero and never competes), so at 90%
sparsity ``density=0.2`` keeps 20% of the 10% that remain. With the phase's start as base every update is zero
where the mask is, so the soup keeps it exactly. Defaults from the paper: the top 20% (k = 20), lambda = 1.
"""

from __future__ import annotations

import torch

from ..registry import SOUPS
from .method import Option, SoupMethod, Tensors
from .uniform import uniform_weights


def kept_entries(base: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The mask's kept entries: nonzero in the start or in any candidate."""
    kept = base != 0
    for x in tensors:
        kept |= x != 0
    return kept


def trim(update: torch.Tensor, kept: torch.Tensor, density: float) -> torch.Tensor:
    """``update`` with all but its ``round(density * kept entries)`` largest magnitudes (among ``kept``) zeroed."""
    values = update[kept]
    k = round(density * values.numel())
    out = torch.zeros_like(update)
    if k:
        top = values.abs().topk(k).indices
        picked = torch.zeros_like(values)
        picked[top] = values[top]
        out[kept] = picked
    return out


@torch.no_grad()
def ties(tensors: list[torch.Tensor], weights: list[float], t: Tensors) -> torch.Tensor:
    base = t.base.to(torch.float64)
    kept = kept_entries(t.base, tensors)
    trimmed = torch.stack([trim(x.to(torch.float64) - base, kept, t.options["density"]) for x in tensors])
    w = torch.tensor(weights, dtype=torch.float64).view(-1, *[1] * base.dim())
    sign = (w * trimmed).sum(0).sign()  # elect: the sign of the (weighted) total update
    agree = (trimmed.sign() == sign) & (trimmed != 0)
    total, count = (w * trimmed * agree).sum(0), (w * agree).sum(0)
    merged = torch.where(count > 0, total / count.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return (base + t.options["scale"] * merged).to(tensors[0].dtype)


TIES_OPTIONS = (
    Option("density", 0.2, 0.0, 1.0, open_low=True, help="fraction of each update's kept entries it keeps"),
    Option("scale", 1.0, 0.0, open_low=True, help="lambda: the merged update's scale"),
)
SOUPS.add("ties", SoupMethod(uniform_weights, combine=ties, needs_base=True, options=TIES_OPTIONS))

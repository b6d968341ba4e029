"""Model Stock (Jang et al., ECCV 2024): per tensor, the candidates' average pulled toward their common start by
the angle between their updates. In SMS the start is the phase's pruned model, so every update is zero where the
mask is and the soup keeps it exactly.

t = k cos(theta) / (1 + (k - 1) cos(theta)), soup = t * average + (1 - t) * start, with cos(theta) the mean
cosine between every pair of the k updates (flattened per tensor, as mergekit's default). Where the paper's
derivation does not reach: k = 1 gives t = 1 (the candidate itself); a pair with a zero update has no angle and is
left out (all updates zero: the soup is the start); a negative mean cosine is taken as 0 (the start), since the
formula's t would leave [0, 1].
"""

from __future__ import annotations

import torch

from ..registry import SOUPS
from .method import SoupMethod, Tensors
from .uniform import uniform_weights


def stock_ratio(updates: list[torch.Tensor]) -> float:
    """Model Stock's t for these updates (float64, flattened)."""
    k = len(updates)
    norms = [float(u.norm()) for u in updates]
    cosines = [
        float((updates[i] * updates[j]).sum()) / (norms[i] * norms[j])
        for i in range(k)
        for j in range(i + 1, k)
        if norms[i] > 0 and norms[j] > 0
    ]
    if not cosines:
        return 1.0
    cos = min(max(sum(cosines) / len(cosines), 0.0), 1.0)
    return k * cos / (1 + (k - 1) * cos) if cos > 0 else 0.0


@torch.no_grad()
def model_stock(tensors: list[torch.Tensor], weights: list[float], t: Tensors) -> torch.Tensor:
    base = t.base.to(torch.float64)
    updates = [x.to(torch.float64) - base for x in tensors]
    average = sum(w * u for w, u in zip(weights, updates))  # the (weighted) average's update
    return (base + stock_ratio(updates) * average).to(tensors[0].dtype)


SOUPS.add("model_stock", SoupMethod(uniform_weights, combine=model_stock, needs_base=True))

"""Uniform random scores: the usual control."""

from __future__ import annotations

import torch

from ...seeding import derive_seed
from . import register_criterion


@register_criterion("random")
def random(tensors, weights, context):
    """Uniform random scores, the usual control: one stream per tensor from ``context.seed`` and its name, so the
    same seed gives the same masks wherever they are computed."""
    out = {}
    for t in tensors:
        generator = torch.Generator().manual_seed(derive_seed(context.seed, "random-criterion", t.name))
        out[t.name] = torch.rand(t.param.shape, generator=generator).to(weights[t.name].device)
    return out

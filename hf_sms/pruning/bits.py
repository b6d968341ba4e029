"""Bool masks as bits (one bit a weight, least significant first), on any device: what a pruning step holds for a
whole model before it is applied (:class:`hf_sms.pruning.masks.PackedMasks`)."""

from __future__ import annotations

import math

import torch


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 bits, least significant first (8x smaller), on its device."""
    flat = keep.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape) -> torch.Tensor:
    """The bool tensor of ``shape`` that :func:`pack_bits` packed."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    flat = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1).bool()
    return flat[: math.prod(shape)].view(shape)

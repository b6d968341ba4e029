"""Keeping pruned weights at exactly zero while training.

No ``torch.nn.utils.prune`` reparametrisation: it breaks ``deepcopy`` and doubles checkpoints. Instead
gradients are masked before clipping and the optimizer step (so clipping norms, Adam moments and
Adafactor's factored statistics see only live weights), and after each step the weights and every
per-element optimizer state are masked again, which also covers optimizers that mix entries.

DPF (Lin et al. 2020) instead keeps the dense weights and only masks them around the forward and backward
pass: :meth:`MaskEnforcer.masked_weights`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .prunable import Masks
from .pruning import validate_masks


class MaskEnforcer:
    """Binds masks to a model's parameters and applies them with fused ``_foreach`` kernels."""

    def __init__(self, model: nn.Module, masks: Masks):
        tensors = validate_masks(model, masks)
        self.masks = masks
        self.params = [tensors[n].param for n in masks]
        # Kept in each weight's dtype: with bool masks _foreach_mul_ promotes types and runs ~3x slower on CPU.
        self._device_masks = [m.to(device=p.device, dtype=p.dtype) for m, p in zip(masks.values(), self.params)]
        self._state_cache: tuple[int, int, int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._dense: list[torch.Tensor] | None = None  # DPF's copy of the dense values, reused every step

    def _sync_devices(self) -> None:
        # The Trainer may move (or cast) the model after the masks were bound.
        if any(m.device != p.device or m.dtype != p.dtype for m, p in zip(self._device_masks, self.params)):
            self._device_masks = [m.to(device=p.device, dtype=p.dtype) for m, p in zip(self._device_masks, self.params)]
            self._state_cache = None

    @torch.no_grad()
    def mask_gradients(self) -> None:
        self._sync_devices()
        pairs = [(p.grad, m) for p, m in zip(self.params, self._device_masks) if p.grad is not None]
        if pairs:
            torch._foreach_mul_([g for g, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def mask_parameters(self) -> None:
        if not self.params:  # no masks (a run that starts dense); _foreach kernels reject empty lists
            return
        self._sync_devices()
        torch._foreach_mul_([p.data for p in self.params], self._device_masks)

    @contextlib.contextmanager
    def masked_weights(self) -> Iterator[None]:
        """Zero the pruned weights inside the block and give the dense values back on exit.

        DPF (Lin et al. 2020, "Dynamic Model Pruning with Feedback"): forward and backward run at the masked
        weights, the gradient (not masked: pruned entries get one too) then updates the dense weights.
        """
        if not self.params:
            yield
            return
        self._sync_devices()
        data = [p.data for p in self.params]
        if self._dense is None or any(d.device != p.device or d.dtype != p.dtype for d, p in zip(self._dense, data)):
            self._dense = [torch.empty_like(p) for p in data]
        with torch.no_grad():
            torch._foreach_copy_(self._dense, data)
            torch._foreach_mul_(data, self._device_masks)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(data, self._dense)

    @torch.no_grad()
    def mask_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero every optimizer state tensor shaped like its parameter (momentum, Adam moments, ...)."""
        self._sync_devices()
        # optimizer.load_state_dict swaps in a new state dict: its id is part of the key.
        key = (id(optimizer), id(optimizer.state), len(optimizer.state))
        if self._state_cache is None or self._state_cache[:3] != key:
            states, masks = [], []
            for p, m in zip(self.params, self._device_masks):
                for v in optimizer.state.get(p, {}).values():
                    if torch.is_tensor(v) and v.shape == p.shape and v.is_floating_point():
                        states.append(v)
                        masks.append(m if m.dtype == v.dtype else m.to(v.dtype))
            self._state_cache = (*key, states, masks)
        states, masks = self._state_cache[3:]
        if states:
            torch._foreach_mul_(states, masks)

    def after_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.mask_parameters()
        if optimizer is not None:
            self.mask_optimizer_state(getattr(optimizer, "optimizer", optimizer))  # accelerate wraps it

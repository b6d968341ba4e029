"""Keeping pruned weights at exactly zero while training: the mask kernels and the masking policies.

No ``torch.nn.utils.prune`` reparametrisation: it breaks ``deepcopy`` and doubles checkpoints. Instead
gradients are masked before clipping and the optimizer step (so clipping norms, Adam moments and
Adafactor's factored statistics see only live weights). With a masked gradient and zero optimizer state at a
pruned weight, SGD (momentum, Nesterov, weight decay), Adam and AdamW leave that weight at exactly zero on their
own, so :class:`ExactMasking` does one pass per step for them; for every other optimizer (Adafactor, Adagrad,
RMSprop, 8-bit ones, anything unknown) it also masks the weights and every per-element optimizer state after
the step. A policy is the object a trainer asks what to mask when; DPF's
(:class:`hf_sms.methods.dpf.FeedbackMasking`) keeps dense weights instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .masks import is_sharded, placed, validate_masks
from .prunable import Masks, prunable_tensors


class MaskEnforcer:
    """Binds masks to a model's parameters and applies them with fused ``_foreach`` kernels."""

    def __init__(self, model: nn.Module, masks: Masks):
        tensors = validate_masks(model, masks)
        self.masks = masks
        self.all_params = [tensors[n].param for n in masks]
        # a frozen weight (subset replicas, adapters) never changes: enforcing its mask every step would be waste
        trained = [n for n in masks if tensors[n].param.requires_grad]
        self.params = [tensors[n].param for n in trained]
        # Kept in each weight's dtype: with bool masks _foreach_mul_ promotes types and runs ~3x slower on CPU.
        # A weight sharded by FSDP2 gets its mask sharded like it: every kernel below then runs on the local shard.
        self._device_masks = [placed(masks[n], p, p.dtype) for n, p in zip(trained, self.params)]
        self._state_cache: tuple[int, int, int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._dense: list[torch.Tensor] | None = None  # DPF's copy of the dense values, reused every step

    def replaced(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights are no longer the parameters bound here: accelerate's FSDP2 (transformers'
        ``fsdp`` arguments) shards a model in place when training starts, into new ``DTensor`` parameters. Bind
        again then, and each mask is sharded like its weight."""
        now = {t.name: t.param for t in prunable_tensors(model)}
        return any(now.get(n) is not p for n, p in zip(self.masks, self.all_params))

    def _sync_devices(self) -> None:
        # The Trainer may move (or cast) the model after the masks were bound.
        if any(m.device != p.device or m.dtype != p.dtype for m, p in zip(self._device_masks, self.params)):
            self._device_masks = [placed(m, p, p.dtype) for m, p in zip(self._device_masks, self.params)]
            self._state_cache = None

    @torch.no_grad()
    def mask_gradients(self) -> None:
        self._sync_devices()
        pairs = [(p.grad, m) for p, m in zip(self.params, self._device_masks) if p.grad is not None]
        if pairs:
            torch._foreach_mul_([g for g, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def mask_frozen(self) -> None:
        """Zero the pruned entries of the frozen weights (once, when masks are set: no step changes them)."""
        trained = {id(p) for p in self.params}
        for p, m in zip(self.all_params, self.masks.values()):
            if id(p) not in trained:
                p.data.mul_(placed(m, p, p.dtype))

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
        """Mask the weights and the optimizer's per-element state (all passes)."""
        self.mask_parameters()
        if optimizer is not None:
            self.mask_optimizer_state(unwrap_optimizer(optimizer))


def unwrap_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


# Optimizers whose update at a weight depends only on that weight's gradient, weight and state, and is exactly
# zero when all three are: with masked gradients and zeroed state a pruned weight stays exactly 0.0. The exact
# type is checked: a subclass may change the update.
KEEPS_ZEROS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def keeps_zeros(optimizer) -> bool:
    """Whether masked gradients alone keep pruned weights at zero under ``optimizer`` (see ``KEEPS_ZEROS``)."""
    return optimizer is not None and type(unwrap_optimizer(optimizer)) in KEEPS_ZEROS


class MaskingPolicy:
    """What a :class:`~hf_sms.SparseSoupTrainer` masks, and when. The trainer calls: ``forward_context()`` around
    each forward and backward (and evaluation), ``before_step()`` once the gradients of a step are complete,
    ``after_step(optimizer)`` after each optimizer step, ``start(optimizer)`` when training begins,
    ``new_masks(optimizer)`` when the masks change, ``end(optimizer)`` when training ends, and
    ``sparsity()`` to log. ``zeroes_at_start``: the trainer zeroes the pruned weights when it starts."""

    zeroes_at_start = True

    def __init__(self):
        self.enforcer: MaskEnforcer | None = None

    def bind(self, enforcer: MaskEnforcer) -> None:
        self.enforcer = enforcer

    def forward_context(self):
        return contextlib.nullcontext()

    def before_step(self) -> None: ...

    def after_step(self, optimizer) -> None: ...

    def start(self, optimizer) -> None: ...

    def new_masks(self, optimizer) -> None: ...

    def end(self, optimizer) -> None: ...

    @torch.no_grad()
    def sparsity(self) -> float:
        """Fraction of the masked weights that are exactly zero."""
        params = self.enforcer.all_params
        counts = [(p == 0).sum() if is_sharded(p) else p.numel() - torch.count_nonzero(p) for p in params]
        # FSDP2: each process counts its shard; the sum over processes (every process logs, in step) is the model's
        zeros = sum(int(c.full_tensor() if is_sharded(c) else c) for c in counts)
        return zeros / max(sum(p.numel() for p in params), 1)


class ExactMasking(MaskingPolicy):
    """Pruned weights exactly zero after every step, with as few passes as the optimizer allows.

    Gradients are masked before clipping and the step. For optimizers in ``KEEPS_ZEROS`` that is all (one pass
    per step); for the others the weights and optimizer state are masked after every step too. Weights and
    state are always masked in full when training starts (state restored on resume) and when the masks change
    (a newly pruned weight carries no momentum into the next step; Zhu & Gupta 2017).
    """

    def __init__(self):
        super().__init__()
        self._state_unmasked = False  # masks changed without the optimizer at hand: its state is still unmasked

    def before_step(self) -> None:
        self.enforcer.mask_gradients()

    def after_step(self, optimizer) -> None:
        if self._state_unmasked or not keeps_zeros(optimizer):
            self.enforcer.after_step(optimizer)
            self._state_unmasked = optimizer is None

    def start(self, optimizer) -> None:
        self.new_masks(optimizer)

    def new_masks(self, optimizer) -> None:
        self.enforcer.mask_frozen()
        self.enforcer.after_step(optimizer)
        self._state_unmasked = optimizer is None

"""Float32 master copies of the half-precision tensors a replica trains outside its adapters (norms, biases).

On a bf16 base a norm weight near 1.0 moves by lr * ~1 per AdamW step: at PERP's 5e-4 that is under half a bf16
step (2**-8 there), so the step rounds away and the tensor never trains. As peft keeps adapters in float32 and
mixed-precision training keeps master weights, the optimizer steps a float32 copy and the model's tensor is that
copy rounded after every step; the replica's trained state is the float32 copy, rounded once into the soup and the
saved folder. Pruned weights (those with a mask) are left to the mask hooks as they are.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from .pruning.enforcement import unwrap_optimizer

MASTER = "hf_sms_master"  # the float32 copy, as an attribute of the half-precision parameter it belongs to
HALF = (torch.float16, torch.bfloat16)


def master_of(param: torch.Tensor) -> torch.Tensor:
    """The float32 master copy of ``param`` where it has one, else ``param`` itself."""
    return getattr(param, MASTER, param)


def half_trained(model: nn.Module, masked: set[str]) -> list[nn.Parameter]:
    """The parameters of ``model`` that train in half precision, other than the ones ``masked`` names (pruned
    weights) and adapters (peft keeps those in float32 already)."""
    return [p for n, p in model.named_parameters() if p.requires_grad and p.dtype in HALF and n not in masked]


class MasterWeights:
    """Steps float32 copies of ``params`` in ``optimizer`` in their place: before each step their gradients are
    copied to the float32 copies (after clipping), after it the copies are rounded into the parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]):
        self.pairs = []
        copies = {}
        for p in params:
            master = getattr(p, MASTER, None)  # a replica resumed from its saved float32 state keeps it
            if master is None or master.shape != p.shape:
                master = p.detach().float().clone()
            setattr(p, MASTER, master)
            copies[id(p)] = master
            self.pairs.append((p, master))
        for group in optimizer.param_groups:
            group["params"] = [copies.get(id(p), p) for p in group["params"]]
        for p, master in self.pairs:  # state restored on resume follows its tensor, in float32
            if p in optimizer.state:
                state = optimizer.state.pop(p)
                optimizer.state[master] = {
                    k: v.float() if torch.is_tensor(v) and v.shape == p.shape else v for k, v in state.items()
                }
        self.hooks = [
            optimizer.register_step_pre_hook(self._gradients),
            optimizer.register_step_post_hook(self._round),
        ]

    def _gradients(self, optimizer, args, kwargs) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def _round(self, optimizer, args, kwargs) -> None:
        for p, master in self.pairs:
            p.copy_(master)
            master.grad = None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class MasterWeightsCallback(TrainerCallback):
    """Gives a trainer's half-precision trained tensors (not its masked weights) float32 master copies while it
    trains: :class:`MasterWeights` on its optimizer from the start of training to its end."""

    def __init__(self, trainer):
        self.trainer, self.masters = trainer, None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        params = half_trained(model, set(self.trainer.masks)) if model is not None else []
        if params and optimizer is not None:
            self.masters = MasterWeights(unwrap_optimizer(optimizer), params)

    def on_train_end(self, args, state, control, **kwargs):
        if self.masters is not None:
            self.masters.remove()
            self.masters = None

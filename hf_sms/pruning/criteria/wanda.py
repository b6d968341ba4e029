"""Wanda (Sun et al. 2024): a weight times the norm of the input feature it reads."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ...batchnorm import forward_batch
from ..prunable import _layer_weights, accepts_labels, unfused_attention
from ..top_k import LazyMapping
from . import register_criterion


@torch.no_grad()
def input_norms(model: nn.Module, example_inputs) -> dict[int, torch.Tensor]:
    """``{id(weight): L2 norm of each input feature}`` over every token of ``example_inputs``, for the linear layers
    (``nn.Linear``, transformers' ``Conv1D``) the batch reaches. One eval forward without gradients."""
    sums: dict[int, torch.Tensor] = defaultdict(lambda: 0)

    def record(module, args):
        x = args[0] if args else None
        if torch.is_tensor(x) and x.is_floating_point():
            sums[id(module.weight)] = sums[id(module.weight)] + x.detach().float().reshape(
                -1, x.shape[-1]
            ).square().sum(0)

    linear = [m for m in model.modules() if (_layer_weights(m) or ("",))[0] == "linear" and hasattr(m, "weight")]
    hooks = [m.register_forward_pre_hook(record) for m in linear]
    was_training = model.training
    model.eval()
    try:
        with unfused_attention():
            forward_batch(model, example_inputs, next(model.parameters()).device, keep_labels=accepts_labels(model))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return {k: v.sqrt() for k, v in sums.items()}


@register_criterion("wanda", needs_inputs=True, per_layer=True)
def wanda(tensors, weights, context):
    """Wanda (Sun et al. 2024): ``|w_ij| * ||x_j||_2``, a weight times the norm of the input feature it reads over
    ``context.example_inputs``. Linear layers the batch reaches only; other weights (convs, embeddings) score
    ``|w|``. The scores compare within a layer only (``per_layer``): a run with it allocates per layer (``uniform``
    by default; ``global`` is refused, it pruned whole layers whose inputs are small)."""
    if context.example_inputs is None:
        raise ValueError("criterion='wanda' scores weights by their inputs: pass a batch as example_inputs")
    norms = input_norms(context.model, context.example_inputs)
    by_name = {t.name: t for t in tensors}

    def scores(name: str) -> torch.Tensor:
        t = by_name[name]
        w, norm = weights[name].abs(), norms.get(id(t.param))
        if norm is not None and t.kind == "linear" and w.dim() == 2:
            norm = norm.to(w.device)
            w = w * (norm[:, None] if t.transposed else norm[None, :])  # Conv1D stores (in, out)
        return w

    return LazyMapping(by_name, scores)  # one layer's scores at a time, as a per-layer allocation reads them

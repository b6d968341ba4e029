"""Pruning criteria: what each weight is worth (docs/method.md §2, §11). One function each, in ``CRITERIA``.

A criterion is a pure function ``(tensors, weights, context) -> {name: scores}``: one score per weight, higher is
kept. ``weights`` are detached float32 copies with pruned entries zeroed. A structure sums the scores of a unit's
weights, so ``"l2"`` ranks units by their L2 norm and ``"l1"`` by their L1 norm; an allocation ranks weights or
units by them.

The contract every criterion keeps: the same model, masks and context give the same scores, bit for bit. The loop
computes masks again and relies on that (every process of a distributed run, a resumed phase, a re-pruned soup),
so randomness comes from ``context.seed`` and activations from ``context.example_inputs``, nothing else.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..batchnorm import forward_batch
from ..registry import CRITERIA
from ..seeding import derive_seed
from .prunable import PrunableTensor, _layer_weights, accepts_labels, unfused_attention

register_criterion = CRITERIA.register


@dataclass(frozen=True)
class CriterionContext:
    """What a criterion may read besides the weights: the model, a batch of inputs, and a seed."""

    model: nn.Module
    example_inputs: object = None
    seed: int = 0


Criterion = Callable[[list[PrunableTensor], dict[str, torch.Tensor], CriterionContext], dict[str, torch.Tensor]]


@register_criterion("magnitude")
def magnitude(tensors, weights, context):
    """``|w|`` (the paper's criterion); a unit's score is its L1 norm."""
    return {n: w.abs() for n, w in weights.items()}


@register_criterion("l1")
def l1(tensors, weights, context):
    """``|w|``: a unit's score is its L1 norm (Li et al. 2017's own filter criterion)."""
    return magnitude(tensors, weights, context)


@register_criterion("l2")
def l2(tensors, weights, context):
    """``w**2``: a unit's score is its squared L2 norm, which ranks units as the norm does (docs/method.md §11)."""
    return {n: w.square() for n, w in weights.items()}


@register_criterion("random")
def random(tensors, weights, context):
    """Uniform random scores, the usual control: one stream per tensor from ``context.seed`` and its name, so the
    same seed gives the same masks wherever they are computed."""
    out = {}
    for t in tensors:
        generator = torch.Generator().manual_seed(derive_seed(context.seed, "random-criterion", t.name))
        out[t.name] = torch.rand(t.param.shape, generator=generator).to(weights[t.name].device)
    return out


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


@register_criterion("wanda", needs_inputs=True)
def wanda(tensors, weights, context):
    """Wanda (Sun et al. 2024): ``|w_ij| * ||x_j||_2``, a weight times the norm of the input feature it reads over
    ``context.example_inputs``. Linear layers the batch reaches only; other weights (convs, embeddings) score
    ``|w|``."""
    if context.example_inputs is None:
        raise ValueError("criterion='wanda' scores weights by their inputs: pass a batch as example_inputs")
    norms = input_norms(context.model, context.example_inputs)
    out = {}
    for t in tensors:
        w, norm = weights[t.name].abs(), norms.get(id(t.param))
        if norm is not None and t.kind == "linear" and w.dim() == 2:
            norm = norm.to(w.device)
            w = w * (norm[:, None] if t.transposed else norm[None, :])  # Conv1D stores (in, out)
        out[t.name] = w
    return out


def criterion_scores(name: str, tensors, weights, context: CriterionContext) -> dict[str, torch.Tensor]:
    """The scores of the criterion ``name`` (a ``ValueError`` names the choices for an unknown one)."""
    return CRITERIA.get(name)(tensors, weights, context)

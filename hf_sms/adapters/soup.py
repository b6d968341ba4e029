"""The soup of replicas that trained a subset of the model, from their trained tensors (docs/replicas.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..registry import SOUPS
from ..soup.averaging import average_tensors
from ..soup.method import SoupMethod
from .replica import kind_of, lora_layers, make_replica, soup_of_states

StateDict = dict[str, torch.Tensor]


def subset_weights(
    start: nn.Module,
    states: Sequence[StateDict],
    method: str | SoupMethod,
    args,
    scores: Sequence[float | None],
    evaluate: Callable[[nn.Module], float] | None = None,
    recalibrate: Callable[[nn.Module], nn.Module] | None = None,
    template: nn.Module | None = None,
) -> list[float]:
    """The soup weights ``method`` picks for replicas that trained a subset of ``start`` (``args.replica_params``),
    from their trained states (:func:`hf_sms.adapters.replica.trained_state`, every replica's on every process).
    ``method`` must be a weighted mean (``combine is None``, one mask): uniform, greedy. A trial soup of adapters is
    scored in adapter form (:func:`adapter_soup`), which writes no weights, so ``start`` is never written here.
    ``template``: a replica of ``start`` made with ``args``, built once for every trial soup."""
    spec = SOUPS.get(method) if isinstance(method, str) else method
    if not spec.weighted_mean:
        raise ValueError("a soup of subset replicas is a weighted mean under one mask: use uniform or greedy")
    template = template if template is not None else make_replica(start, args)
    adapters = kind_of(args).adapters is not None

    def trial(weights: list[float]) -> float:
        if evaluate is None:
            raise ValueError("this soup method evaluates trial soups: pass evaluate=<validation metric>")
        with contextlib.ExitStack() as stack:
            if adapters:
                model = stack.enter_context(adapter_soup(template, states, weights))
            else:  # a copy of the few tensors that change
                model = soup_of_states(start, *_used(states, weights), args, template)
            return float(evaluate(recalibrate(model) if recalibrate is not None else model))

    return spec.select(list(scores), trial, args)


def subset_soup(start: nn.Module, states: Sequence[StateDict], method, args, scores, **kwargs):
    """``(soup, weights)``: the soup of replicas that trained a subset of ``start`` with the weights
    :func:`subset_weights` picks (``kwargs``: its ``evaluate``, ``recalibrate``, ``template``), built beside
    ``start`` by :func:`build_subset_soup`."""
    template = kwargs.pop("template", None)
    template = template if template is not None else make_replica(start, args)
    weights = subset_weights(start, states, method, args, scores, template=template, **kwargs)
    return build_subset_soup(start, states, weights, args, kwargs.get("recalibrate"), template), weights


def build_subset_soup(start, states, weights, args, recalibrate=None, template=None, in_place: bool = False):
    """``start`` plus the weighted sum of the updates in ``states`` (``weights``), one layer at a time (never m
    models), with ``start``'s zeros exactly, BatchNorm recalibrated by ``recalibrate``; ``in_place``: written into
    ``start`` itself."""
    model = soup_of_states(start, *_used(states, weights), args, template, in_place=in_place)
    return recalibrate(model) if recalibrate is not None else model


def _used(states: Sequence[StateDict], weights: Sequence[float]) -> tuple[list[StateDict], list[float]]:
    used = [i for i, w in enumerate(weights) if w]
    return [states[i] for i in used], [weights[i] for i in used]


@contextlib.contextmanager
def adapter_soup(template: nn.Module, states: Sequence[StateDict], weights: Sequence[float], adapter: str = "default"):
    """``template`` (a MaskLoRA / ScaleLoRA replica of the start) made the soup of ``states`` with ``weights`` (summing
    to 1) in adapter form, restored on exit. The weighted sum of k gated rank-r updates is one gated update of rank
    k*r, ``G * (s [w_1 B_1 ... w_k B_k] [A_1; ...; A_k])``: the soup the merge writes, up to rounding, for the cost of
    k adapters instead of new weights for every adapted layer. Without LoRA dropout: the merged soup has none."""
    states, weights = _used(states, weights)
    saved, params = [], dict(template.named_parameters())
    plain = {k: params[k].detach().clone() for k in states[0] if ".lora_" not in k}  # a "_norms" kind's norms
    try:
        for key in plain:
            params[key].data.copy_(average_tensors([s[key] for s in states], weights))
        for prefix, layer in lora_layers(template):
            a, b = layer.lora_A[adapter], layer.lora_B[adapter]
            saved.append((layer, a.weight, b.weight, layer.lora_dropout[adapter]))
            key = f"{prefix}.lora_%s.{adapter}.weight"
            stacked = torch.cat([s[key % "A"].to(a.weight) for s in states])
            sided = torch.cat([w * s[key % "B"].to(b.weight) for w, s in zip(weights, states)], dim=1)
            a.weight, b.weight = nn.Parameter(stacked, requires_grad=False), nn.Parameter(sided, requires_grad=False)
            layer.lora_dropout[adapter] = nn.Identity()
        yield template
    finally:
        for layer, a, b, dropout in saved:
            layer.lora_A[adapter].weight, layer.lora_B[adapter].weight = a, b
            layer.lora_dropout[adapter] = dropout
        for key, value in plain.items():
            params[key].data.copy_(value)
